"""Resume through state_dict: the README's loop, stopped anywhere and resumed, gives exactly the
batches of the uninterrupted run."""

from __future__ import annotations

import json
import pickle

import pytest

import gpufeed

EPOCHS = 3
SETTINGS = dict(batch_size=96, shuffle=7, workers=2, output="numpy")


def make(packed, **over):
    return gpufeed.Loader(packed, **{**SETTINGS, **over})


def readme_loop(loader, first_epoch, stop_after=None):
    """The README's loop (set_epoch at the top); returns the (epoch, labels) seen and, if it
    stopped after `stop_after` batches, the state then."""
    seen = []
    for epoch in range(first_epoch, EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            seen.append((epoch, batch["label"].tolist()))
            if stop_after is not None and len(seen) == stop_after:
                return seen, loader.state_dict()
    return seen, None


def test_the_state_is_plain_python(packed):
    loader = make(packed)
    next(iter(loader))
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["next_batch"] == 1
    assert json.loads(json.dumps(state)) == state
    assert pickle.loads(pickle.dumps(state)) == state


@pytest.mark.parametrize("stop_after", [1, 5, 10, 11, 12, 21, 22, 32])
def test_stop_anywhere_resume_and_the_joined_run_is_the_uninterrupted_one(packed, stop_after):
    whole, _ = readme_loop(make(packed), 0)
    assert len(whole) == 33  # 11 batches of each of 3 epochs
    head, state = readme_loop(make(packed), 0, stop_after)
    assert state is not None
    # As a checkpoint would: through JSON, into a new process's new loader.
    state = json.loads(json.dumps(state))
    resumed = make(packed)
    resumed.load_state_dict(state)
    tail, _ = readme_loop(resumed, state["epoch"])
    assert head + tail == whole


def test_load_state_dict_on_a_running_loader(packed):
    whole, _ = readme_loop(make(packed), 0)
    loader = make(packed)
    head, state = readme_loop(loader, 0, 15)
    for _ in loader:  # run on past the state, into other batches
        pass
    loader.load_state_dict(state)
    tail, _ = readme_loop(loader, state["epoch"])
    assert head + tail == whole


def test_loops_without_set_epoch_resume_too(packed):
    def plain(loader, epochs, stop_after=None):
        seen = []
        for _ in range(epochs):
            for batch in loader:
                seen.append(batch["label"].tolist())
                if len(seen) == stop_after:
                    return seen, loader.state_dict()
        return seen, None

    whole, _ = plain(make(packed), EPOCHS)
    head, state = plain(make(packed), EPOCHS, 14)
    resumed = make(packed)
    resumed.load_state_dict(state)
    tail, _ = plain(resumed, EPOCHS - state["epoch"])
    assert head + tail == whole


def test_a_state_of_other_settings_is_refused_naming_it(packed):
    state = make(packed).state_dict()
    other = make(packed, batch_size=64)
    with pytest.raises(gpufeed.ConfigError) as e:
        other.load_state_dict(state)
    assert e.value.argument == "state_dict" and "order settings" in str(e.value)
    with pytest.raises(gpufeed.ConfigError):
        other.load_state_dict({"epoch": 0})
    with pytest.raises(TypeError):
        other.load_state_dict({"epoch": object()})
    # The loader is unharmed.
    assert len(list(b["label"].copy() for b in other)) == len(other)
