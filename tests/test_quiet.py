"""`tf32lab.workloads.quiet.quiet_loading`: transformers' and huggingface_hub's own logging and progress-bar
settings are as they were after it, whatever they were and however it was entered."""

from __future__ import annotations

import importlib
import threading

import pytest

pytest.importorskip("transformers")
from transformers.utils import logging

from tf32lab.workloads.quiet import quiet_loading

hub_bars = importlib.import_module("huggingface_hub.utils.tqdm")  # the module (the package exports a class of its name)


@pytest.fixture
def settings():
    """transformers' and huggingface_hub's settings put back after the test, whatever it did to them."""
    if hub_bars.HF_HUB_DISABLE_PROGRESS_BARS is not None:
        pytest.skip("HF_HUB_DISABLE_PROGRESS_BARS decides huggingface_hub's bars here")
    bar, verbosity, states = logging.is_progress_bar_enabled(), logging.get_verbosity(), \
        dict(hub_bars.progress_bar_states)
    yield lambda: (logging.is_progress_bar_enabled(), logging.get_verbosity(), dict(hub_bars.progress_bar_states))
    logging.set_verbosity(verbosity)
    (logging.enable_progress_bar if bar else logging.disable_progress_bar)()
    hub_bars.progress_bar_states.clear()
    hub_bars.progress_bar_states.update(states)


def test_huggingface_hubs_own_progress_bar_settings_are_kept(settings):
    # a user who turned one group of huggingface_hub's bars off (or all of them, transformers' left on) keeps it so
    logging.enable_progress_bar()
    hub_bars.disable_progress_bars("huggingface_hub.http_get")
    before = settings()
    with quiet_loading():
        assert not logging.is_progress_bar_enabled()
    assert settings() == before
    assert hub_bars.are_progress_bars_disabled("huggingface_hub.http_get")


def test_transformers_bar_off_and_huggingface_hubs_on_are_kept(settings):
    logging.disable_progress_bar()
    hub_bars.enable_progress_bars()
    before = settings()
    with quiet_loading():
        pass
    assert settings() == before
    assert not hub_bars.are_progress_bars_disabled()


def test_two_threads_loading_at_once_leave_the_settings_as_they_were(settings):
    # thread one enters, thread two enters while one is inside, one leaves, then two leaves
    logging.enable_progress_bar()
    logging.set_verbosity_warning()
    before = settings()
    inside, left = threading.Event(), threading.Event()

    def one() -> None:
        with quiet_loading():
            inside.set()
            assert left.wait(10)

    thread = threading.Thread(target=one)
    thread.start()
    assert inside.wait(10)
    with quiet_loading():
        left.set()
        thread.join(10)
        assert not logging.is_progress_bar_enabled()  # still loading here: still quiet
    assert settings() == before


def test_settings_are_put_back_when_loading_raises(settings):
    logging.enable_progress_bar()
    before = settings()
    with pytest.raises(OSError), quiet_loading(), quiet_loading():
        raise OSError("no such folder")
    assert settings() == before
