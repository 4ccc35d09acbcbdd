"""The ``engine`` command.

    engine serve [--model DIR|FILE.gguf] [--port 8000] ...   OpenAI-compatible HTTP API
    engine generate PROMPT [--max-tokens N] ...    one generation, printed to stdout
    engine precompute FILE... [--split-on SEP]     store RAG chunks' KV for CacheBlend
    engine calibrate [--error 0.12] ...            the cachegen codec's table for a model
    engine export --out DIR [--model FILE.gguf]    a GGUF model as a Hugging Face directory

serve, generate and precompute run with lmkv when ``LMKV_CONFIG_FILE`` is set (precompute
needs it); calibrate takes lmkv's settings from it and ``LMKV_<KEY>`` variables; export
does not read them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict
from pathlib import Path

from lmkv.codec.calibration import CalibrationSettings
from lmkv.sizes import size

from .config import EngineConfig
from .sampling_params import SamplingParams
from .server_config import LOG_LEVELS, ServerConfig


def port_number(text: str) -> int:
    port = int(text)
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (1-65535)")
    return port


LMKV_HELP = ("lmkv is on when the environment variable LMKV_CONFIG_FILE names its YAML config "
             "(e.g. LMKV_CONFIG_FILE=examples/local_cpu_disk.yaml: a CPU hot cache over a disk "
             "tier; keys in docs/configuration.md); without it the engine runs without lmkv.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="lmkv's bundled LLM engine",
                                     epilog=LMKV_HELP)
    commands = parser.add_subparsers(dest="command", required=True)

    engine_args = argparse.ArgumentParser(add_help=False)
    g = engine_args.add_argument_group("engine")
    g.add_argument("--model", help="Llama-family Hugging Face directory or .gguf file; "
                   "'demo' is the random-weight demo model (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights and KV memory (default auto: bfloat16 on a GPU from Ampere on, "
                        "float16 on an older one, float32 on the CPU)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--kv-cache-memory", type=size, default=EngineConfig.kv_cache_memory,
                   help="paged KV memory, e.g. 2GiB (default 1GiB)")
    g.add_argument("--num-kv-blocks", type=int, help="KV blocks (overrides --kv-cache-memory)")
    g.add_argument("--max-model-len", type=int,
                   help="context length (default: the model's, capped by the KV memory)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests run at once (default 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens computed per step (default 2048; without chunked prefill, "
                        "max_model_len)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV of shared prompt prefixes (default on)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts over steps (default on)")
    g.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    g.add_argument("--device", default=EngineConfig.device,
                   help="auto (cuda when torch sees a GPU, else cpu), cpu, cuda, cuda:N, or emulate "
                   "(lmkv's CUDA kernels under the CPU emulator: slow, for tests); default auto")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs")

    serve = commands.add_parser("serve", parents=[engine_args], epilog=LMKV_HELP,
                                help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--served-model-name", help="model name of the API (default: --model)")
    serve.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    serve.add_argument("--port", type=port_number, default=8000, help="default 8000")
    serve.add_argument("--max-pending", type=int, default=ServerConfig.max_pending,
                       help="requests that may wait beyond --max-num-seqs; more get HTTP 503 "
                       "(default %(default)s)")
    serve.add_argument("--max-request-body", type=size, default=ServerConfig.max_request_body,
                       help="largest request body accepted; larger ones get HTTP 413 (default 8MiB)")
    serve.add_argument("--max-request-bodies", type=size,
                       help="total size of the bodies of the requests handled at once; a request "
                       "past it gets HTTP 503 (default 256MiB, or --max-request-body if larger)")
    serve.add_argument("--request-body-timeout", type=float,
                       default=ServerConfig.request_body_timeout, metavar="SECONDS",
                       help="how long a request's whole body may take to arrive; a slower one "
                            "gets HTTP 408, and a connection whose request head has not "
                            "arrived whole by then is closed (default %(default)s)")
    serve.add_argument("--graceful-shutdown-timeout", type=float,
                       default=ServerConfig.graceful_shutdown_timeout, metavar="SECONDS",
                       help="on SIGTERM or SIGINT, how long requests in flight may run on "
                            "(then they end with HTTP 503; default %(default)g)")
    serve.add_argument("--log-level", choices=LOG_LEVELS, default="info")

    gen = commands.add_parser("generate", parents=[engine_args], epilog=LMKV_HELP,
                              help="generate from one prompt and print the text")
    gen.add_argument("prompt", help="text the model continues (with --chat: a user's message)")
    gen.add_argument("--chat", action="store_true",
                     help="send the prompt as a user's message through the model's chat template "
                          "(as /v1/chat/completions does): what an instruct model answers")
    gen.add_argument("--max-tokens", type=int, help="default 16")
    gen.add_argument("--temperature", type=float, help="default 1.0; 0 is greedy")
    gen.add_argument("--top-p", type=float, help="nucleus sampling: the smallest set of tokens "
                     "with this much probability (default 1.0: all)")
    gen.add_argument("--top-k", type=int, help="sample among the k likeliest tokens "
                     "(default: all)")
    gen.add_argument("--seed", type=int, help="seed of this request's sampling (default: random)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="go on past the model's end-of-text token, up to --max-tokens")
    gen.add_argument("--log-level", choices=LOG_LEVELS, default="warning")

    pre = commands.add_parser("precompute", parents=[engine_args], epilog=LMKV_HELP
                              + " precompute needs it, with a disk or remote tier to outlive the process.",
                              help="compute and store the KV of RAG document chunks (lmkv)")
    pre.add_argument("files", nargs="+", help="text files; each is one chunk unless --split-on")
    pre.add_argument("--split-on", help="split each file into chunks at this string "
                     "(e.g. a blank line: $'\\n\\n'); line ends around each chunk are dropped")
    pre.add_argument("--batch-size", type=int, default=8,
                     help="chunks computed together in one engine run (default 8)")
    pre.add_argument("--log-level", choices=LOG_LEVELS, default="warning")

    exp = commands.add_parser("export", help="write a GGUF model (default: SmolLM2) as a Hugging "
                              "Face directory, for other engines (vLLM) to run the same weights")
    exp.add_argument("--model", help="a .gguf file (default: SmolLM2-135M-Instruct)")
    exp.add_argument("--out", required=True, help="the directory to write")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    exp.add_argument("--log-level", choices=LOG_LEVELS, default="warning")

    cal = commands.add_parser("calibrate", parents=[engine_args], epilog=LMKV_HELP,
                              help="measure the model's KV for the cachegen codec (lmkv)")
    cal.add_argument("--out", help="table file (default: lmkv's cachegen_calibration, else "
                     "$LMKV_CACHE_DIR (default ~/.cache/lmkv)/calibration/<key scope>.safetensors, "
                     "where lmkv looks)")
    cal.add_argument("--prompts", type=int, default=8, help="calibration prompts (default 8)")
    cal.add_argument("--length", type=int, help="tokens per prompt (default 1024, or a chunk and "
                     "16 tokens where lmkv's chunk_size is above 1008)")
    cal.add_argument("--text", help="a text file to cut prompts from (default: random tokens)")
    cal.add_argument("--error", type=float, default=CalibrationSettings.error,
                     help="relative error target of layer 0's keys on the ramp; with the "
                          "layers weighed, the ramp's predicted effect on the output spread "
                          "evenly over the layers (default %(default)s)")
    cal.add_argument("--deep-ratio", type=float, default=CalibrationSettings.deep_ratio,
                     help="last layer's target / first layer's; below 1: deep layers finer "
                          "(default %(default)s)")
    cal.add_argument("--value-ratio", type=float, default=CalibrationSettings.value_ratio,
                     help="V's target / K's (default %(default)s)")
    cal.add_argument("--group-size", type=int, default=CalibrationSettings.group_size,
                     help="tokens per delta group (default %(default)s)")
    cal.add_argument("--no-transform", dest="transform", action="store_false",
                     help="code channels as they are, without the decorrelating transform "
                          "(default: the transform where it makes the calibration KV smaller)")
    cal.add_argument("--ramp", dest="weigh_layers", action="store_false",
                     help="keep the ramp's targets (default: weigh each layer by its measured "
                          "effect on the model's output: 2 x layers extra passes per prompt)")
    cal.add_argument("--log-level", choices=LOG_LEVELS, default="warning")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        served_model_name=getattr(args, "served_model_name", None),
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
        num_threads=args.num_threads,
        device=args.device,
        enforce_eager=args.enforce_eager,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # told with the subcommand's usage, not the top-level one
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        try:
            config = ServerConfig(
                engine=engine_config(args), host=args.host, port=args.port,
                max_pending=args.max_pending, log_level=args.log_level,
                max_request_body=args.max_request_body,
                max_request_bodies=args.max_request_bodies,
                request_body_timeout=args.request_body_timeout,
                graceful_shutdown_timeout=args.graceful_shutdown_timeout,
                lmkv_config_file=os.environ.get("LMKV_CONFIG_FILE") or None,
            )
        except ValueError as e:
            parser.error(str(e))
        return _serve(config)
    if args.command == "export":
        from .export import export_hf

        try:
            print(export_hf(args.model, args.out, args.dtype))
        except (OSError, ValueError) as e:
            print(f"engine export: error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "calibrate":
        try:
            config = engine_config(args)
            settings = CalibrationSettings(args.error, args.deep_ratio, args.value_ratio,
                                           args.group_size, args.transform,
                                           weigh_layers=args.weigh_layers)
        except ValueError as e:
            parser.error(str(e))
        return _calibrate(config, settings, args)
    if args.command == "precompute":
        try:
            config = engine_config(args)
        except ValueError as e:
            parser.error(str(e))
        return _precompute(config, args.files, args.split_on, args.batch_size)
    try:
        config = engine_config(args)
        given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                 "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "stop": args.stop}
        params = SamplingParams(ignore_eos=args.ignore_eos,
                                **{k: v for k, v in given.items() if v is not None})
    except ValueError as e:
        parser.error(str(e))
    return _generate(config, args.prompt, params, args.chat)


def _serve(config: ServerConfig) -> int:
    from .api_server import StartupError, serve

    try:
        serve(config)
    except StartupError as e:
        print(f"engine serve: error: {e}", file=sys.stderr)
        return 1
    return 0


def _lmkv_config():
    """lmkv's config when LMKV_CONFIG_FILE is set, else None (lmkv off)."""
    from lmkv.config import load_config, off_but_configured

    path = os.environ.get("LMKV_CONFIG_FILE")
    if not path:
        if warning := off_but_configured():
            logging.getLogger("lmkv").warning("%s", warning)
        return None

    return load_config(path)


def _generate(config: EngineConfig, prompt: str, params: SamplingParams, chat: bool) -> int:
    from .llm import LLM

    try:
        lmkv_config = _lmkv_config()
        with LLM(lmkv_config=lmkv_config, **asdict(config)) as llm:
            if chat:  # the template places BOS and the turn markers
                text = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
                out = llm.generate([llm.engine.tokenize(text, add_special_tokens=False)], params)[0]
            else:
                out = llm.generate(prompt, params)[0]
    except (OSError, ValueError) as e:
        print(f"engine generate: error: {e}", file=sys.stderr)
        return 1
    print(out.text)
    if lmkv_config is not None:  # what lmkv did for this prompt
        print(f"engine generate: {out.num_external_tokens} of {len(out.prompt_token_ids)} prompt "
              "tokens loaded from lmkv", file=sys.stderr)
    if not out.text.strip() and out.finish_reason == "stop":  # a bare empty line says nothing
        hint = "" if chat else "; an instruct model answers a question given with --chat"
        print(f"engine generate: the model ended the text at once ({len(out.output_token_ids)} "
              f"tokens){hint}", file=sys.stderr)
    return 0


def _calibrate(config: EngineConfig, settings: CalibrationSettings, args: argparse.Namespace) -> int:
    from lmkv.config import load_config

    from .calibrate import calibrate_model

    if settings.weigh_layers and logging.getLogger().level <= logging.WARNING:
        progress = logging.getLogger("lmkv.codec.calibrate")  # minutes on a real model: say
        progress.setLevel(min(progress.getEffectiveLevel(), logging.INFO))  # how far it got
    try:
        text = Path(args.text).read_text(encoding="utf-8") if args.text else None
        engine_args = {k: v for k, v in asdict(config).items()
                       if k not in ("model", "enable_prefix_caching")}
        # (lmkv's settings name the table: the file's when LMKV_CONFIG_FILE is set, and
        # LMKV_<KEY> variables either way, as the serve that will use the table reads them)
        table, path = calibrate_model(config.model, load_config(), settings,
                                      args.prompts, args.length, text, args.out, **engine_args)
    except (OSError, ValueError) as e:
        print(f"engine calibrate: error: {e}", file=sys.stderr)
        return 1
    print(f"cachegen table {table.table_id:016x} -> {path}")
    if table.basis is None:
        why = "off by --no-transform" if not settings.transform else "it did not make this KV smaller"
        print(f"decorrelating transform: off ({why}); delta coding per layer (K):",
              table.delta[0].int().tolist(), "(V):", table.delta[1].int().tolist())
    else:
        stored = table.bands[..., -1]
        print(f"decorrelating transform: on; coefficients stored per layer (K): {stored[0].tolist()} "
              f"(V): {stored[1].tolist()} of {table.basis.shape[-1]}")
    how = "on the ramp"
    if settings.weigh_layers:
        moved = not bool((table.target == settings.targets(table.num_layers)).all())
        how = ("weighed by each layer's measured effect on the output" if moved
               else "on the ramp: no layer's coding moved the output measurably")
    targets = lambda kv: " ".join(f"{x:.2g}" for x in table.target[kv].tolist())  # noqa: E731
    print(f"error targets per layer ({how}), K: {targets(0)}; V: {targets(1)}")
    print("keys: measured before RoPE and coded un-rotated (each chunk's position in its payload)"
          if table.rope is not None else "keys: coded as rotated (the model reports no rotary frequencies)")
    return 0


def _precompute(config: EngineConfig, files: list[str], split_on: str | None,
                batch_size: int) -> int:
    from .llm import LLM

    try:
        lmkv_config = _lmkv_config()
        if lmkv_config is None:
            raise ValueError("precompute stores into lmkv: set LMKV_CONFIG_FILE")
        if not (lmkv_config.local_disk or lmkv_config.remote_url):
            print("engine precompute: warning: no disk or remote tier configured; the chunks "
                  "live only as long as this process", file=sys.stderr)
        missing = [name for name in files if not os.path.isfile(name)]
        if missing:
            raise ValueError(f"no such file: {', '.join(missing)}")

        unreadable = []

        def chunks():  # one file read at a time, as precompute takes them
            for name in files:
                try:
                    with open(name, encoding="utf-8-sig") as f:  # (a byte-order mark is not text)
                        text = f.read()
                except (UnicodeDecodeError, OSError) as e:  # that file alone: the others are stored
                    why = (f"is not UTF-8 text ({e.reason} at byte {e.start})"
                           if isinstance(e, UnicodeDecodeError) else f"cannot be read ({e.strerror or e})")
                    print(f"engine precompute: error: {name} {why}; skipped", file=sys.stderr)
                    unreadable.append(name)
                    continue
                # the line ends around a document or a part (a third newline between
                # paragraphs split at a blank line) are not part of it as a prompt holds it
                parts = text.split(split_on) if split_on else [text]
                yield from (p.strip("\n") for p in parts if p.strip())

        with LLM(lmkv_config=lmkv_config, **asdict(config)) as llm:
            report = llm.precompute(chunks(), batch_size=batch_size)
    except (OSError, ValueError) as e:
        print(f"engine precompute: error: {e}", file=sys.stderr)
        return 1
    print(f"precompute: {report.stored} chunks stored, {report.skipped} already stored, "
          f"{report.failed} failed, {report.tokens} tokens in {report.seconds:.1f}s"
          + (f"; {len(unreadable)} files not read" if unreadable else ""))
    return 0 if report.failed == 0 and not unreadable else 1


if __name__ == "__main__":
    sys.exit(main())
