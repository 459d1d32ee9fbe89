"""The check behind tests/gpu/test_graphs.py's replays (tests/gpu/graph_safety.py) catches what a CUDA
graph would get wrong, and lets through what it would get right."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.graph_safety import GraphContractError, StrictReplay, record, strict_eager


def test_a_replay_over_the_same_buffers_passes():
    weight, buffer, out = torch.randn(4, 4), torch.randn(2, 4), torch.zeros(2, 4)

    def fn() -> None:
        out.copy_(torch.relu(buffer @ weight) * 0.5 + 1.0)  # temporaries in between

    replay = StrictReplay(fn)
    buffer.copy_(torch.randn(2, 4))  # new values in the same memory: what a replay is for
    replay.replay()
    replay.replay()
    assert replay.replays == 2
    torch.testing.assert_close(out, torch.relu(buffer @ weight) * 0.5 + 1.0)


def test_a_replay_that_reads_a_tensor_made_after_its_capture_fails():
    request = {"keys": torch.randn(4)}
    out = torch.zeros(4)
    replay = StrictReplay(lambda: out.copy_(request["keys"] * 2))
    kept = request["keys"]  # held, so the next tensor cannot take its address
    request["keys"] = torch.randn(4)  # the next request's: a graph would still read the first one
    with pytest.raises(GraphContractError, match="call 0"):
        replay.replay()
    assert kept is not request["keys"]


def test_a_replay_that_slices_by_another_count_fails():
    buffer, n = torch.zeros(8), [4]
    replay = StrictReplay(lambda: buffer[: n[0]].add_(1))
    n[0] = 5  # a graph would add to the first 4 again
    with pytest.raises(GraphContractError):
        replay.replay()


def test_a_replay_with_another_python_number_or_another_temporary_shape_fails():
    x, out, scale = torch.ones(4), torch.zeros(4), [2.0]
    replay = StrictReplay(lambda: out.copy_(x * scale[0]))
    scale[0] = 3.0  # baked into the graph at capture
    with pytest.raises(GraphContractError):
        replay.replay()
    rows = [3]
    grown = StrictReplay(lambda: out[:1].copy_(torch.zeros(rows[0], 4).sum()))
    rows[0] = 5
    with pytest.raises(GraphContractError):
        grown.replay()


def test_a_read_back_to_the_host_fails_at_capture_and_a_host_scalars_value_counts():
    x, out = torch.ones(4), torch.zeros(4)
    with pytest.raises(GraphContractError, match="reads the device back"):
        StrictReplay(lambda: out.fill_(x.sum().item()))
    with pytest.raises(GraphContractError, match="reads the device back"):
        StrictReplay(lambda: out[: int(torch.nonzero(x).shape[0])].zero_())
    scale = torch.tensor(2.0)  # a 0-dim host tensor: a CUDA graph keeps its value
    replay = StrictReplay(lambda: out.copy_(x * scale))
    scale.fill_(3.0)
    with pytest.raises(GraphContractError):
        replay.replay()


def test_a_replay_that_makes_more_calls_than_its_capture_fails():
    x, extra = torch.ones(4), [False]

    def fn() -> None:
        x.mul_(1.0)
        if extra[0]:
            x.add_(0.0)

    replay = StrictReplay(fn)
    extra[0] = True
    with pytest.raises(GraphContractError, match="made 1 calls, the replay 2"):
        replay.replay()


def test_temporaries_are_told_from_buffers_by_where_they_came_from():
    buffer = torch.zeros(3)
    calls = record(lambda: buffer.copy_(torch.ones(3) + 1))
    where = [[arg[0] for arg in args if isinstance(arg, tuple)] for _, (args, _) in calls]
    assert where == [[], ["made"], ["at", "made"]]  # ones, add(ones, 1), copy_(buffer, sum)
    assert len(strict_eager([lambda: None, lambda: None])) == 2


def test_the_layer_graphs_meet_it_and_a_buffer_rebound_instead_of_filled_is_caught(tiny_tokenizer, monkeypatch):
    """ragkv.gpu.graphs's recompute layers under the check (test_graphs.py runs every CPU test so),
    and the mistake it is for: a request's rows bound to the buffer's name instead of copied into
    its memory. Eager, that computes the same; a CUDA graph would read the old buffer."""
    from ragkv.gpu import graphs
    from ragkv.model import load_model
    from tests.conftest import make_model

    a = load_model((make_model("llama", len(tiny_tokenizer)), tiny_tokenizer), device="cpu", dtype=torch.float32)
    monkeypatch.setenv("RAGKV_RECOMPUTE_GRAPHS", "eager")
    monkeypatch.setattr(graphs, "_eager", strict_eager)
    monkeypatch.setattr(graphs, "_MODELS", graphs.weakref.WeakKeyDictionary())
    made = graphs.layer_graphs(a, 8, "recompute")
    assert made is not None and isinstance(made.before[0], StrictReplay)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.transpose(1, 2) * 0.5  # [1, n, heads, D]

    def run(seed: int) -> torch.Tensor:
        hidden = torch.randn(1, 6, a.model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        pe = a.position_embeddings(torch.arange(6), hidden)
        return made.run(1, hidden, pe, attend)

    run(1), run(2)
    assert made.before[1].replays == made.after[1].replays == 2

    def rebound(self, hidden: torch.Tensor, pe: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.hidden = torch.cat([hidden, hidden.new_zeros(1, self.rows - hidden.shape[1], hidden.shape[2])], dim=1)
        self.buffers.load_rope(pe, hidden.shape[1])

    old = made.buffers.hidden.untyped_storage().data_ptr()
    monkeypatch.setattr(graphs.LayerGraphs, "start", rebound)
    with pytest.raises(GraphContractError, match=f"'at', {old},"):  # the first read of the old buffer
        run(3)
