// Shadows the CUDA header of the same name when a kernel is built for the CPU emulator.
#pragma once
#include "cuemu/cuemu.h"
