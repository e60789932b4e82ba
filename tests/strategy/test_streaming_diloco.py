"""Streaming DiLoCo: DiLoCo when unfragmented, each fragment once per H steps at 1/F of the bytes, the outer
gradient applied tau steps late (pinned by hand), overlap on the virtual clock, and validation pairs."""

import math

import pytest
import torch
from torch.testing import assert_close

import toy
from exogym import Trainer
from exogym.comm.transport import all_reduce_bytes
from exogym.comm.compression import ErrorFeedback, FP4Quantizer, TopK
from exogym.cluster.network import Network
from exogym.strategy import CommunicateOptimizeStrategy, DiLoCoStrategy, OptimSpec, StreamingDiLoCoStrategy
from exogym.strategy.streaming_diloco import StreamingDiLoCoCommunicator
from strategy_toys import FIT, NODES, run_linear, watched_module

SGD = OptimSpec(torch.optim.SGD, lr=0.1)


class Stack(torch.nn.Module):
    """Four equal layers (8x8 weight + bias each), so every fragment of F in {1, 2, 4} has the same size."""

    def __init__(self, layers=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, batch):
        h, y = batch
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return torch.nn.functional.cross_entropy(h[:, :3], y)


def fit(strategy, model=None, nodes=2, steps=24, **kwargs):
    NODES.clear()
    trainer = Trainer(model or toy.TinyMLP(), toy.make_classification(256))
    final = trainer.fit(strategy, nodes, batch_size=8, max_steps=steps, **{**FIT, **kwargs})
    return final, trainer.record


def test_one_fragment_no_overlap_no_mixing_is_diloco_step_for_step():
    for kwargs in ({}, dict(quantization_bits=8)):
        diloco, d = fit(DiLoCoStrategy(H=5, **kwargs), steps=23)
        streaming, s = fit(StreamingDiLoCoStrategy(H=5, num_fragments=1, tau=0, alpha=0.0, **kwargs), steps=23)
        for a, b in zip(diloco.parameters(), streaming.parameters()):
            assert_close(a, b, rtol=0, atol=0)
        assert_close(torch.tensor(s.column("loss")), torch.tensor(d.column("loss")), rtol=0, atol=0)
        assert s.bytes_per_node == d.bytes_per_node


class RecordingStreaming(StreamingDiLoCoCommunicator):
    SENT: list = []

    def _send(self, fragment, local_step):
        if self.rank == 0:
            self.SENT.append((local_step, fragment))
        super()._send(fragment, local_step)


@pytest.mark.parametrize("pattern, expected", [("sequential", [[0, 1], [2, 3]]), ("strided", [[0, 2], [1, 3]])])
def test_every_fragment_syncs_once_per_h_steps_at_1_over_f_of_the_bytes(pattern, expected):
    H, F, steps = 8, 2, 24
    RecordingStreaming.SENT = []
    module = watched_module(RecordingStreaming)(H, num_fragments=F, fragment_pattern=pattern, tau=1,
                                                final_sync=False)  # the schedule's syncs only
    _, streaming = fit(CommunicateOptimizeStrategy([module], SGD), model=Stack(), steps=steps)
    layers = [[2 * l, 2 * l + 1] for l in range(4)]  # weight and bias of each layer
    assert NODES[0][1].fragments == [[i for l in group for i in layers[l]] for group in expected]
    assert RecordingStreaming.SENT == [(s, (s // (H // F) - 1) % F) for s in range(H // F, steps + 1, H // F)]
    for start in range(0, steps, H):  # in every window of H steps, each fragment exactly once
        assert sorted(f for s, f in RecordingStreaming.SENT if start < s <= start + H) == list(range(F))
    _, diloco = fit(DiLoCoStrategy(SGD, H=H, final_sync=False), model=Stack(), steps=steps)

    def syncs(record):
        cumulative = [row["bytes"] for row in record.train]
        return [b - a for a, b in zip([0] + cumulative, cumulative) if b != a]

    model_bytes = 4 * 4 * (8 * 8 + 8)
    assert syncs(diloco) == [all_reduce_bytes(model_bytes, 2)] * (steps // H)  # per node
    assert syncs(streaming) == [all_reduce_bytes(model_bytes // F, 2)] * (steps // (H // F))
    assert max(syncs(streaming)) * F == max(syncs(diloco))
    assert streaming.bytes_per_node == diloco.bytes_per_node  # the same bytes per H steps, spread out


def test_four_fragments_of_four_layers():
    _, record = fit(StreamingDiLoCoStrategy(SGD, H=8, num_fragments=4, tau=1, final_sync=False), model=Stack(),
                    steps=16)
    assert record.bytes_per_node == [2 * all_reduce_bytes(4 * 4 * 72, 2)] * 2  # two rounds of the whole model


GRADS = [[1.0, -2.0, 0.5], [3.0, 0.0, -1.0]]  # node r's constant gradient (strategy_toys.Linear)
INIT = [1.0, 2.0, 3.0]
ETA, H, TAU, ALPHA, OUTER_LR = 0.1, 4, 2, 0.5, 0.7


class Trace(StreamingDiLoCoStrategy):
    """Records, after every step, the global model and the node's model."""
    TRACE: dict = {}

    def step(self):
        super().step()
        master = torch.cat([g.detach().reshape(-1) for g in self.modules[0].master])
        local = torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])
        self.TRACE[(self.rank, self.local_step)] = (master.clone(), local.clone())


def reference(steps):
    """By hand, plain outer SGD: a node moves eta c_r per step; after step nH the pseudo-gradient
    Delta_r = theta_g - theta_r is sent; after step nH + tau, theta_g -= lr mean(Delta) (the Delta sent tau steps
    before, not the current difference) and theta_r = (1 - alpha) theta_g + alpha theta_r."""
    c = torch.tensor(GRADS)
    g, local, sent, out = torch.tensor(INIT), [torch.tensor(INIT)] * 2, None, {}
    for t in range(1, steps + 1):
        local = [x - ETA * c[r] for r, x in enumerate(local)]
        if t % H == 0:
            sent = torch.stack([g - x for x in local]).mean(0)
        if t % H == TAU and t > H:
            g = g - OUTER_LR * sent
            local = [(1 - ALPHA) * g + ALPHA * x for x in local]
        out[t] = (g, local)
    return out


def test_the_outer_gradient_applied_is_the_one_sent_tau_steps_before():
    steps = 3 * H + TAU + 1
    Trace.TRACE = {}
    strategy = Trace(OptimSpec(torch.optim.SGD, lr=ETA), H=H, num_fragments=1, tau=TAU, alpha=ALPHA, outer_lr=OUTER_LR,
                     outer_momentum=0.0)
    run_linear(strategy, GRADS, INIT, steps)
    expected = reference(steps)
    for t in range(1, steps + 1):
        g, local = expected[t]
        for r in range(2):
            assert_close(Trace.TRACE[(r, t)][0], g, rtol=1e-5, atol=1e-6, msg=f"global model after step {t}")
            assert_close(Trace.TRACE[(r, t)][1], local[r], rtol=1e-5, atol=1e-6, msg=f"node {r} after step {t}")
    # the pinned numbers themselves: nothing moves before step H + tau, then exactly lr * eta * H * mean(c)
    assert torch.equal(expected[H + TAU - 1][0], torch.tensor(INIT))
    assert_close(expected[H + TAU][0], torch.tensor(INIT) - OUTER_LR * ETA * H * torch.tensor(GRADS).mean(0))


def test_a_fragment_in_flight_at_the_last_step_is_applied():
    model, _ = run_linear(StreamingDiLoCoStrategy(OptimSpec(torch.optim.SGD, lr=ETA), H=H, num_fragments=1, tau=TAU,
                                                  alpha=0.0, outer_lr=1.0, outer_momentum=0.0), GRADS, INIT, H + 1)
    assert_close(model.w.detach(), torch.tensor(INIT) - ETA * H * torch.tensor(GRADS).mean(0))


def test_overlap_hides_the_transfer_behind_tau_steps_of_compute():
    net, steps, syncs = Network(bandwidth="inf", latency=0.5), 18, 4  # sends after 4, 8, 12, 16; all applied by 18

    def sim_time(tau):
        _, record = fit(StreamingDiLoCoStrategy(SGD, H=8, num_fragments=2, tau=tau, final_sync=False), model=Stack(),
                        steps=steps, network=net, device_flops=1e6)
        return record, record.sim_time_per_node[0]["compute_s"] / steps

    blocking, c = sim_time(0)
    overlapped, _ = sim_time(2)
    assert 2 * c < 0.5
    assert math.isclose(blocking.sim_time_s, steps * c + syncs * 0.5)
    assert math.isclose(overlapped.sim_time_s, steps * c + syncs * (0.5 - 2 * c))  # each wait after 2 steps' compute


def test_resuming_from_a_checkpoint_taken_with_a_fragment_in_flight_is_identical(tmp_path):
    def run(**kwargs):  # fragment 0 is sent after step 4 and applied after step 6; the checkpoint is at step 5
        strategy = StreamingDiLoCoStrategy("adamw", H=8, num_fragments=2, tau=2, compression=ErrorFeedback(TopK(0.3)))
        return Trainer(toy.TinyMLP(), toy.make_classification(80)).fit(strategy, 2, batch_size=8, max_steps=14,
                                                                       **FIT, **kwargs)

    full = run()
    run(checkpoint_interval=5, checkpoint_dir=tmp_path)
    resumed = run(resume_from=tmp_path / "step_000000005")
    assert all(torch.equal(a, b) for a, b in zip(full.parameters(), resumed.parameters()))


@pytest.mark.spawns
def test_the_torch_backend_gives_the_same_run():
    def run(backend):  # async all-reduces of fragments, all-gathers of packed top-k + fp4 payloads with memory
        strategy = StreamingDiLoCoStrategy(SGD, H=4, num_fragments=2, tau=1,
                                           compression=ErrorFeedback(TopK(0.3, values=FP4Quantizer())))
        trainer = Trainer(toy.TinyMLP(), toy.make_classification(128))
        model = trainer.fit(strategy, 2, batch_size=8, max_steps=9, backend=backend, **FIT)
        return model, trainer.record

    (sim, sim_record), (dist, dist_record) = run("sim"), run("torch")
    for a, b in zip(sim.parameters(), dist.parameters()):
        assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert dist_record.bytes_per_node == sim_record.bytes_per_node


@pytest.mark.parametrize("bad, error, message, boundary", [
    (dict(H=10, num_fragments=3), ValueError, "H must be divisible by num_fragments", dict(H=10, num_fragments=5)),
    (dict(H=8, num_fragments=2, tau=4), ValueError, "tau must be < H/num_fragments = 8/2 = 4, got tau=4",
     dict(H=8, num_fragments=2, tau=3)),
    (dict(tau=-1), ValueError, "tau must be >= 0", dict(tau=0)),
    (dict(alpha=1.5), ValueError, "alpha must be <= 1.0", dict(alpha=1.0)),
    (dict(alpha=-0.1), ValueError, "alpha must be >= 0.0", dict(alpha=0.0)),
    (dict(num_fragments=0), ValueError, "num_fragments must be >= 1", dict(num_fragments=1)),
    (dict(fragment_pattern="blocks"), ValueError, "['strided', 'sequential']", dict(fragment_pattern="sequential")),
    (dict(quantization_bits=2), ValueError, "quantization_bits must be 8 or 4", dict(quantization_bits=4)),
    (dict(drop_prob=1.0), ValueError, "drop_prob must be < 1", dict(drop_prob=0.0)),
])
def test_validation_pairs(bad, error, message, boundary):
    with pytest.raises(error) as info:
        StreamingDiLoCoStrategy(**bad)
    assert message in str(info.value)
    StreamingDiLoCoStrategy(**boundary)


def test_more_fragments_than_layers_is_rejected_naming_the_layers():
    with pytest.raises(ValueError, match=r"num_fragments=3 is more than the model's 2 layers .*'net.0', 'net.3'"):
        fit(StreamingDiLoCoStrategy(H=6, num_fragments=3, tau=0), steps=1)
    fit(StreamingDiLoCoStrategy(H=6, num_fragments=2, tau=0), steps=1)



def test_outer_optimizer_spellings_are_checked_like_diloco():
    import pytest

    from exogym.strategy import StreamingDiLoCoStrategy

    with pytest.raises(TypeError, match="got both outer_optim_spec="):
        StreamingDiLoCoStrategy(outer_optim_spec="sgd", outer_optim="adam")
    with pytest.raises(ValueError, match="does not offer 'sgd_normalized'"):
        StreamingDiLoCoStrategy(outer_optim="sgd_normalized")
    StreamingDiLoCoStrategy(outer_optim="sgd", outer_lr=0.5)  # the boundary: accepted
