from __future__ import annotations

import pytest

from lmkv.sizes import parse_size
from lmkv_server.cli import build_parser
from lmkv_server.config import GIB, MIB, ServerConfig, is_loopback


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GIB),
        ("512MB", 512 * 10**6),
        ("512mib", 512 * MIB),
        ("64k", 64 * 1024),
        ("1048576", 1 << 20),
        ("1.5GiB", 3 * GIB // 2),
        (" 8 MiB ", 8 * MIB),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4 parsecs", "-1", "4GiBs"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_config_validation():
    assert ServerConfig().num_pages == 1 * GIB // (256 * 1024)  # 1 GiB by default: a laptop-sized first run
    with pytest.raises(ValueError, match="--page-size"):
        ServerConfig(page_size=1000)
    with pytest.raises(ValueError, match="below one page"):
        ServerConfig(max_memory=1024)
    with pytest.raises(ValueError, match="--max-value-size"):
        ServerConfig(max_value_size=3 * GIB)
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="--log-level 'CHATTY' .one of DEBUG, INFO, WARNING"):
        ServerConfig(log_level="CHATTY")
    assert ServerConfig(log_level="warn").log_level == "WARNING"  # uvicorn knows no "warn"
    assert ServerConfig(log_level="Fatal").log_level == "CRITICAL"
    with pytest.raises(ValueError, match="--cache-policy must be one of lru, .*got 'mru'"):
        ServerConfig(cache_policy="mru")
    with pytest.raises(ValueError, match="--idle-timeout must be 0"):
        ServerConfig(idle_timeout=-1)
    for bad in (float("inf"), float("nan"), 1e-7, 0):  # inf, nan: no deadline; 1e-7: a 0 timeval
        with pytest.raises(ValueError, match="--io-timeout must be in"):
            ServerConfig(io_timeout=bad)
        if bad:
            with pytest.raises(ValueError, match="--idle-timeout must be 0"):
                ServerConfig(idle_timeout=bad)


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not ServerConfig(host="0.0.0.0").loopback_only


def test_cli_parses_sizes():
    args = build_parser().parse_args(["0.0.0.0", "9000", "--max-memory", "512MB"])
    assert args.max_memory == 512 * 10**6 and args.port == 9000 and args.prefault
    assert args.idle_timeout == 0  # off unless asked for


def test_allow_list():
    from lmkv_server.config import parse_networks

    config = ServerConfig(allow=parse_networks("10.0.0.0/8, 192.168.1.7,::1"))
    assert config.allows("10.1.2.3") and config.allows("192.168.1.7") and config.allows("::1")
    assert config.allows("::ffff:10.0.0.1")  # IPv4-mapped, as a dual-stack socket reports
    assert not config.allows("192.168.1.8") and not config.allows("127.0.0.1")
    assert ServerConfig().allows("203.0.113.9")  # no list: anyone
    with pytest.raises(ValueError, match="not an address"):
        parse_networks("10.0.0.0/33")
    for empty in ("", ",", " "):  # (--allow "$NETS" with NETS unset let anyone in)
        with pytest.raises(ValueError, match="names no address or network"):
            parse_networks(empty)
    mapped = ServerConfig(allow=parse_networks("::ffff:127.0.0.0/104"))  # as a v4 peer is seen
    assert mapped.allows("127.0.0.1") and mapped.allows("::ffff:127.0.0.2")
    assert not mapped.allows("10.0.0.1")


def test_cli_rejects_bad_values(capsys):
    from lmkv_server.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["127.0.0.1", "9000", "--max-memory", "1KiB"])
    assert exit_info.value.code == 2
    assert "--max-memory 1024 is below one page" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the flag the user typed, not the setting's field
        main(["127.0.0.1", "9000", "--page-size", "1000"])
    assert "--page-size must be a multiple of 4KiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["127.0.0.1", "9000", "--max-memory", "lots"])


def test_more_memory_than_the_machine_maps_is_a_clear_error(capsys):
    """--max-memory beyond what mmap gives (1 EiB here): exit 1 and one line naming the
    flag, not a traceback."""
    import socket

    from lmkv_server.cli import main

    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    assert main(["127.0.0.1", str(port), "--max-memory", str(1 << 60), "--no-prefault"]) == 1
    err = capsys.readouterr().err
    assert "lmkv_server: error: --max-memory" in err and "Traceback" not in err


def test_engine_cli_errors_name_the_flag(capsys):
    """`engine generate --max-num-seqs 0` said "invalid engine setting max_num_seqs": the
    field, not the flag typed; both are named (the Python API takes the field)."""
    from lmkv_engines.minimal.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--max-num-seqs", "0"])
    assert "max_num_seqs (--max-num-seqs): must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--max-request-body", "10"])
    assert "max_request_body (--max-request-body): must be >= 1KiB" in capsys.readouterr().err
