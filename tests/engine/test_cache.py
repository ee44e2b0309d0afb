"""The engine cache on stories260K: built once per checkpoint content and shape, reused untouched, and an
unusable cached dir is rebuilt, never used."""

import shutil
from pathlib import Path

import pytest

from trt_lookahead.engine.cache import cache_request, cached_engine
from trt_lookahead.engine.format import CONFIG_FILE, load_engine_config
from trt_lookahead.lookahead.config import LookaheadConfig

STORIES = Path(__file__).parents[1] / "fixtures" / "stories260K"
SHAPE = {"dtype": "float32", "lookahead": LookaheadConfig(2, 3, 2), "max_seq_len": 64, "max_batch": 2}


@pytest.mark.export
def test_built_once_reused_and_rebuilt_when_unusable(tmp_path):
    root = tmp_path / "engines"
    path, why = cached_engine(STORIES, root=root, **SHAPE)
    assert why == "not built yet" and load_engine_config(path).max_batch == 2
    built = (path / CONFIG_FILE).stat().st_mtime_ns
    assert cached_engine(STORIES, root=root, **SHAPE) == (path, None)  # reused
    assert (path / CONFIG_FILE).stat().st_mtime_ns == built  # untouched

    (path / CONFIG_FILE).write_text("{ truncated")
    again, why = cached_engine(STORIES, root=root, **SHAPE)
    assert again == path and why is not None and "not valid JSON" in why
    assert load_engine_config(path).max_batch == 2  # a whole engine again
    assert sorted(p.name for p in root.iterdir()) == sorted([path.name, f".{path.name}.lock"])  # no leftovers


def test_the_key_is_the_checkpoint_content_and_the_shape(tmp_path):
    """Another shape or dtype is another engine; a copy of the checkpoint elsewhere (the same weights) is the
    same one: keyed by the weights' sha256, named by the checkpoint dir's name."""
    copy = tmp_path / "copy" / STORIES.name
    shutil.copytree(STORIES, copy)
    changes = {"same": {}, "batch": {"max_batch": 3}, "config": {"lookahead": LookaheadConfig(2, 3, 3)},
               "length": {"max_seq_len": 65}, "dtype": {"dtype": "float16"}}
    place = {name: cache_request(STORIES, root=tmp_path, **{**SHAPE, **change})[0].output
             for name, change in changes.items()}
    assert len(set(place.values())) == len(place) and place["same"].name.startswith("stories260K-")
    assert cache_request(copy, root=tmp_path, **SHAPE)[0].output == place["same"]
