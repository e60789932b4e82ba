"""A strategy of one's own as the original EXO Gym wrote them: extra keywords kept as attributes, lr_callbacks; the
"has no effect" warning only on the built-in strategies; one metaclass; the adapters' ignored settings handed to
fit explicitly."""

import inspect
import json
import warnings
from pathlib import Path

import pytest
import torch

import toy
from exogym import Trainer
from exogym.adapters import Adaptable, adaptable, register_adapter
from exogym.comm.transport import all_reduce_bytes
from exogym.strategy import DiLoCoStrategy, FedAvgStrategy, OptimSpec
from exogym.strategy.strategy import SimpleReduceStrategy, Strategy

FIT = dict(progress=False, device="cpu", val_interval=10_000)


class EveryH(Strategy):
    """Model averaging every H steps, written as the original's users write strategies: no __init__ of its own,
    H= goes to the base class, which keeps it."""

    def step(self):
        self.optim.step()
        if (self.local_step + 1) % self.H == 0:
            self.communicate_models()
        super().step()


def _trainer():
    return Trainer(toy.TinyMLP(), toy.make_classification(256))


def test_a_strategy_of_ones_own_keeps_its_extra_keywords_as_attributes():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "has no effect" warning: it has an effect
        strategy = EveryH(H=2, optim_spec=OptimSpec(torch.optim.SGD, lr=0.1), note="mine")
    assert strategy.H == 2 and strategy.note == "mine"
    trainer = _trainer()
    trainer.fit(strategy, 4, max_steps=6, batch_size=8, run_name="everyh", **FIT)
    model_bytes = 4 * sum(p.numel() for p in toy.TinyMLP().parameters())
    assert trainer.record.bytes_per_node == [3 * all_reduce_bytes(model_bytes, 4)] * 4  # rounds at steps 2, 4, 6
    config = json.loads(Path("logs/everyh/config.json").read_text())
    assert config["strategy_config"]["H"] == 2 and "ignored" not in config


def test_the_warning_and_the_errors_stay_where_they_are_true():
    with pytest.warns(UserWarning, match=r"SimpleReduceStrategy has no H, so H=2 has no effect"):
        built_in = SimpleReduceStrategy(H=2)
    assert not hasattr(built_in, "H") and built_in.ignored_settings["H"]["value"] == 2
    with pytest.raises(TypeError, match=r"'lrr' \(did you mean 'lr'\?\)"):
        DiLoCoStrategy(lrr=0.1)  # a built-in strategy: a typo is an error
    with pytest.raises(TypeError, match=r"EveryH got step=, which would replace what a strategy already has"):
        EveryH(step=1)
    with pytest.raises(TypeError, match=r"EveryH got optimizer="):
        EveryH(optimizer=None)  # a property of the base class
    # your own composition: H= was meant for a module
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) 'H'"):
        from exogym.strategy import CommunicateOptimizeStrategy
        CommunicateOptimizeStrategy([], H=2)


def test_lr_callbacks_get_node_0s_learning_rate_after_each_step():
    seen = []
    strategy = SimpleReduceStrategy(OptimSpec(torch.optim.SGD, lr=0.1), lr_scheduler="lambda_cosine",
                                    lr_scheduler_kwargs={"warmup_steps": 3, "cosine_anneal": True})
    strategy.lr_callbacks.append(seen.append)
    trainer = _trainer()
    trainer.fit(strategy, 3, max_steps=6, batch_size=8, logger=False, **FIT)
    lrs = [row["lr"] for row in trainer.record.train]  # the lr each step trained with
    assert len(seen) == 6 and seen[:-1] == pytest.approx(lrs[1:])  # node 0 only, the next step's lr
    assert seen[0] > lrs[0]  # warming up


def test_strategy_has_one_metaclass():
    assert type(Strategy) is Adaptable and type(Strategy).__mro__ == (Adaptable, type, object)
    assert type(FedAvgStrategy) is Adaptable


def test_adapters_hand_their_ignored_settings_to_the_function_explicitly():
    seen = {}

    @adaptable
    def target(a, *, b=1, ignored_settings=None):
        seen["ignored"] = ignored_settings
        return a + b

    register_adapter(target, lambda f, args, kwargs: (args, {k: v for k, v in kwargs.items() if k != "old"},
                                                      {"old": (kwargs["old"], "no such knob")} if "old" in kwargs
                                                      else {}))
    assert list(inspect.signature(target).parameters) == ["a", "b"]  # hidden from help() and the signature
    assert target(1, b=2, old=5) == 3 and seen["ignored"] == {"old": (5, "no such knob")}
    assert target(1) == 2 and seen["ignored"] == {}
    with pytest.raises(TypeError, match="unexpected keyword argument 'ignored_settings'"):
        target(1, ignored_settings={"x": (1, "forged")})


def test_fit_shows_the_same_signature_and_records_what_the_adapters_ignored():
    shown = inspect.signature(Trainer.fit)
    own = inspect.signature(inspect.unwrap(Trainer.fit))
    assert "ignored_settings" not in shown.parameters
    assert list(shown.parameters) == [p for p in own.parameters if p != "ignored_settings"]
    assert own.parameters["ignored_settings"].kind is inspect.Parameter.KEYWORD_ONLY
    import exogym.fit.config as fit_setup  # where fit takes its settings (was fit_setup)
    assert not any(hasattr(fit_setup, n) for n in ("note_ignored_settings", "take_ignored_settings", "_IGNORED"))
    trainer = _trainer()
    trainer.fit(num_epochs=1, max_steps=2, strategy=SimpleReduceStrategy(), num_nodes=2, batch_size=8,
                save_dir="ck", run_name="ign", **FIT)
    ignored = json.loads(Path("logs/ign/config.json").read_text())["ignored"]
    assert ignored["save_dir"] == {"value": "ck",
                                   "reason": "no checkpoint_interval: nothing is saved (as the original)"}
    trainer.fit(SimpleReduceStrategy(), 2, max_steps=2, batch_size=8, run_name="plain", **FIT)
    assert "ignored" not in json.loads(Path("logs/plain/config.json").read_text())  # nothing carried over


def test_disable_logging_logs_nothing():
    trainer = _trainer()
    trainer.fit(num_epochs=1, max_steps=2, strategy=SimpleReduceStrategy(), num_nodes=2, batch_size=8,
                disable_logging=True, **FIT)
    assert not Path("logs").exists() and len(trainer.record.train) == 2
    with pytest.raises(TypeError, match=r"disable_logging=True and wandb_project='p'"):
        trainer.fit(SimpleReduceStrategy(), 2, max_steps=2, disable_logging=True, wandb_project="p", **FIT)
