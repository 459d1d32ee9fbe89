"""The thread policy: fixed counts, the adaptive choice from load readings, the env variable."""

from __future__ import annotations

import pytest
import torch

from ragkv.model import threads
from ragkv.model.threads import ThreadPolicy, policy_from_env


def test_the_first_reading_only_opens_the_window():
    p = ThreadPolicy(max_threads=4, interval_s=1.0)
    assert p.choose(100.0, 10.0, 0.0) == 4
    assert p.others_busy is None


@pytest.mark.parametrize(
    ("machine_delta", "own_delta", "want"),
    [
        (2.0, 2.0, 4),  # only this process was busy: every core
        (3.0, 2.0, 3),  # another process kept one core busy
        (1.2, 0.0, 3),  # 1.2 cores busy elsewhere: 2.8 free, rounds to 3
        (1.8, 0.0, 2),
        (9.0, 0.0, 1),  # the others fill the machine: still one thread
    ],
)
def test_threads_follow_what_other_processes_leave_free(machine_delta, own_delta, want):
    p = ThreadPolicy(max_threads=4, interval_s=1.0)
    p.choose(100.0, 10.0, 0.0)
    assert p.choose(100.0 + machine_delta, 10.0 + own_delta, 1.0) == want


def test_a_reading_within_the_interval_keeps_the_choice():
    p = ThreadPolicy(max_threads=2, interval_s=1.0)
    p.choose(0.0, 0.0, 0.0)
    assert p.choose(1.0, 0.0, 1.0) == 1  # one core busy elsewhere
    assert p.choose(1.0, 0.0, 1.5) == 1  # half a second later: no new window, same choice
    assert p.choose(1.0, 0.0, 2.0) == 2  # a quiet second: both cores


def test_a_fixed_count_is_kept_and_set():
    before = torch.get_num_threads()
    try:
        p = ThreadPolicy(fixed=1)
        assert p.choose(0.0, 0.0, 0.0) == 1 and p.apply() == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_apply_reads_this_machine_and_stays_within_bounds():
    before = torch.get_num_threads()
    try:
        p = ThreadPolicy(max_threads=2, interval_s=0.0)
        assert 1 <= p.apply() <= 2
        assert 1 <= p.apply() <= 2 and 1 <= torch.get_num_threads() <= 2
    finally:
        torch.set_num_threads(before)


def test_the_env_variable_names_the_policy():
    assert policy_from_env("torch") is None
    assert policy_from_env("auto").fixed is None
    assert policy_from_env("3").fixed == 3
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="RAGKV_THREADS must be"):
            policy_from_env(bad)


def test_the_tests_leave_torch_threads_alone(monkeypatch):
    monkeypatch.setattr(threads, "_policy_read", False)
    before = torch.get_num_threads()
    assert threads.adapt_threads() == before  # conftest sets RAGKV_THREADS=torch
