"""Importing sparsehi (and its plugin package) never needs SGLang; the options still check."""
import argparse
import subprocess
import sys

import pytest

from sparsehi.sglang_plugin import ATTR, add_arguments, config_from_namespace


def test_import_without_sglang():
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'sglang' or name.startswith('sglang.'): raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "import sparsehi, sparsehi.sglang_plugin, sparsehi.sglang_plugin.hooks\n"
            "assert not any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def _ns(argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_off_without_algorithm():
    assert config_from_namespace(_ns([])) is None
    assert ATTR == "sparsehi_config"


def test_min_sparse_prompt_len_and_page_size_default():
    """The selection page is the plugin's own (64), whatever SGLang's page size (1 by
    default); no dense layers unless named."""
    cfg = config_from_namespace(_ns(["--sparsehi-algorithm", "quest", "--sparsehi-min-sparse-prompt-len", "0"]),
                                sglang_page_size=1)
    assert cfg.min_sparse_prompt_len == 0 and cfg.page_size == 64 and cfg.dense_layers == ()


@pytest.mark.parametrize("argv, flag", [
    (["--sparsehi-algorithm", "quest", "--sparsehi-recent-tokens", "0"], "--sparsehi-recent-tokens"),
    (["--sparsehi-algorithm", "quest", "--sparsehi-host-to-device-ratio", "1"], "--sparsehi-host-to-device-ratio"),
    (["--sparsehi-min-sparse-prompt-len", "5"], "--sparsehi-algorithm"),
])
def test_errors_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        config_from_namespace(_ns(argv))
