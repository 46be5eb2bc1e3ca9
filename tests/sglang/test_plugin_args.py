"""The plugin inside SGLang 0.5.23's real plugin loader and server-argument parser.

Runs in the SGLang test environment (.venv-sglang, scripts/setup_sglang_env.sh); the
main environment has no SGLang and reports these tests as skipped.
"""
from __future__ import annotations

import argparse
from importlib.metadata import entry_points

import pytest

pytest.importorskip("sglang.srt.plugins", reason="SGLang is not installed (run scripts/setup_sglang_env.sh)")

from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from sparsehi.sglang_plugin import ATTR  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    load_plugins()  # idempotent in SGLang; applies HookRegistry's hooks
    return True


def _parse(argv: list[str]):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "dummy", *argv]))


def test_entry_point_is_visible():
    eps = {ep.name: ep.value for ep in entry_points(group=GENERAL_PLUGINS_GROUP)}
    assert eps.get("sparsehi") == "sparsehi.sglang_plugin:register"


def test_load_plugins_applies_the_hooks(loaded):
    assert hasattr(ServerArgs.add_cli_args, "__wrapped__")
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert {"--sparsehi-algorithm", "--sparsehi-top-k", "--sparsehi-device-buffer-size",
            "--sparsehi-min-sparse-prompt-len"} <= flags


def test_flags_parse_into_sparse_config(loaded):
    sa = _parse(["--page-size", "16", "--sparsehi-algorithm", "quest", "--sparsehi-top-k", "256",
                 "--sparsehi-device-buffer-size", "512", "--sparsehi-min-sparse-prompt-len", "100",
                 "--sparsehi-backend", "triton"])
    cfg = getattr(sa, ATTR)
    assert (cfg.algorithm, cfg.top_k, cfg.device_buffer_size, cfg.min_sparse_prompt_len, cfg.backend) == \
        ("quest", 256, 512, 100, "triton")
    assert cfg.page_size == 64  # the selection page is the plugin's own, whatever SGLang's --page-size
    assert sa.page_size == 16
    assert cfg.dense_layers == ()  # no layer keeps a whole context on the GPU unless asked
    sa = _parse(["--sparsehi-algorithm", "quest", "--sparsehi-page-size", "16", "--sparsehi-dense-layers", "0,1",
                 "--sparsehi-max-sparse-requests", "12", "--sparsehi-host-to-device-ratio", "4",
                 "--sparsehi-lookahead-tokens", "32"])
    cfg = getattr(sa, ATTR)
    assert (cfg.page_size, cfg.dense_layers, cfg.max_sparse_requests, cfg.host_to_device_ratio) == (16, (0, 1), 12, 4.0)
    assert cfg.lookahead_tokens == 32
    assert sa.page_size in (None, 1)  # SGLang's default page size (resolved to 1 later)


@pytest.mark.parametrize("argv, flag", [
    (["--sparsehi-algorithm", "quest", "--sparsehi-top-k", "0"], "--sparsehi-top-k"),
    (["--sparsehi-algorithm", "quest", "--sparsehi-top-k", "4096", "--sparsehi-device-buffer-size", "2048"],
     "--sparsehi-device-buffer-size"),
    (["--sparsehi-algorithm", "quest", "--sparsehi-backend", "flashinfer"], "--sparsehi-backend"),
    (["--sparsehi-algorithm", "quest", "--sparsehi-page-size", "48"], "--sparsehi-page-size"),
    (["--sparsehi-top-k", "256"], "--sparsehi-algorithm"),
    (["--sparsehi-algorithm", "quest", "--sparsehi-dense-layers", "0,x"], "--sparsehi-dense-layers"),
    (["--sparsehi-algorithm", "quest", "--sparsehi-max-sparse-requests", "0"], "--sparsehi-max-sparse-requests"),
    (["--sparsehi-algorithm", "quest", "--sparsehi-lookahead-tokens", "20"], "--sparsehi-lookahead-tokens"),
])
def test_bad_values_are_rejected_naming_the_flag(loaded, argv, flag):
    with pytest.raises(ValueError, match=flag):
        _parse(argv)


def test_non_integer_is_an_argparse_error(loaded, capsys):
    with pytest.raises(SystemExit):
        _parse(["--sparsehi-algorithm", "quest", "--sparsehi-top-k", "many"])
    assert "--sparsehi-top-k" in capsys.readouterr().err


def test_without_flags_server_args_are_unchanged(loaded):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "dummy", "--enable-hierarchical-cache", "--hicache-ratio", "3"])
    hooked = ServerArgs.from_cli_args(ns)
    plain = ServerArgs.from_cli_args.__wrapped__(ServerArgs, ns)
    assert getattr(hooked, ATTR) is None
    from sglang.srt.arg_groups.arg_utils import record_fields
    for f in record_fields(ServerArgs):
        assert getattr(hooked, f.name) == getattr(plain, f.name), f.name
    # the radix cache stays on with ours
    sa = _parse(["--sparsehi-algorithm", "quest"])
    assert not sa.disable_radix_cache and getattr(sa, ATTR) is not None
