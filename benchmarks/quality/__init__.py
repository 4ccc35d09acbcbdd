"""Quality of a model's outputs, and how much a lossy KV path changes them.

metrics.py holds the metric functions (plain torch, importable by any benchmark or test);
probe.py runs the bundled engine to get logits, KV and greedy tokens; qa.py builds the
held-out multi-document QA prompts; ``python -m benchmarks.quality.run --model DIR``
prints one line per metric.
"""
