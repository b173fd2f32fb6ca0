"""Session-scoped tiny Qwen2 checkpoints (tied and untied) written by transformers."""

import pytest

from . import helpers


@pytest.fixture(scope="session")
def hf_untied(tmp_path_factory):
    return helpers.write_checkpoint(tmp_path_factory.mktemp("untied"), tie=False, seed=0)


@pytest.fixture(scope="session")
def hf_tied(tmp_path_factory):
    return helpers.write_checkpoint(tmp_path_factory.mktemp("tied"), tie=True, seed=10)


@pytest.fixture(scope="session", params=["untied", "tied"])
def hf_ckpt(request, hf_untied, hf_tied):
    return hf_untied if request.param == "untied" else hf_tied
