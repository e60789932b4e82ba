"""The optimizer name form takes the optimizer's own options wherever a name is accepted."""

import pytest
import torch

from exogym.strategy import (CommunicateOptimizeStrategy, DiLoCoStrategy, FedAvgStrategy, OptimSpec,
                             SimpleReduceStrategy, SPARTADiLoCoStrategy, SPARTAStrategy, StreamingDiLoCoStrategy)
from exogym.strategy.diloco import DiLoCoCommunicator

SGD_MOMENTUM = OptimSpec(torch.optim.SGD, lr=0.05, momentum=0.9)


@pytest.mark.parametrize("build", [
    lambda: SimpleReduceStrategy("sgd", lr=0.05, momentum=0.9),
    lambda: SPARTAStrategy("sgd", lr=0.05, momentum=0.9),
    lambda: DiLoCoStrategy("sgd", lr=0.05, momentum=0.9, H=5),
    lambda: FedAvgStrategy("sgd", lr=0.05, momentum=0.9, H=2),
    lambda: SPARTADiLoCoStrategy("sgd", lr=0.05, momentum=0.9),
    lambda: StreamingDiLoCoStrategy("sgd", lr=0.05, momentum=0.9, H=8, num_fragments=2),
    lambda: CommunicateOptimizeStrategy([DiLoCoCommunicator(H=5)], "sgd", lr=0.05, momentum=0.9),
    lambda: SPARTAStrategy(torch.optim.SGD, lr=0.05, momentum=0.9),
    lambda: DiLoCoStrategy(inner_optim="sgd", lr=0.05, momentum=0.9),
])
def test_the_name_form_takes_the_optimizers_options(build):
    s = build()
    assert s.optim_spec == SGD_MOMENTUM
    assert s.config()["momentum"] == 0.9  # the run's config.json says how it was built
    optim = s.optim_spec.build(torch.nn.Linear(2, 2))
    assert optim.param_groups[0]["momentum"] == 0.9


def test_options_of_the_default_optimizer():
    assert FedAvgStrategy(momentum=0.5).optim_spec == OptimSpec(torch.optim.SGD, lr=0.01, momentum=0.5)  # SGD
    assert SimpleReduceStrategy(betas=(0.8, 0.9)).optim_spec == OptimSpec(torch.optim.AdamW, lr=1e-3,
                                                                          betas=(0.8, 0.9))


def test_unknown_options_name_the_optimizers_accepted_ones():
    with pytest.raises(TypeError, match=r"SPARTAStrategy got unexpected keyword argument\(s\) 'momentun' \(did you "
                                        r"mean 'momentum'\?\); accepted keywords are: .*p_sparta.*; its optimizer SGD "
                                        r"accepts: dampening, .*momentum, nesterov"):
        SPARTAStrategy("sgd", lr=0.05, momentun=0.9)
    with pytest.raises(TypeError, match=r"'momentum'.*its optimizer AdamW accepts: amsgrad, betas"):
        SimpleReduceStrategy("adamw", momentum=0.9)
    # A strategy typo still points at the strategy's keyword.
    with pytest.raises(TypeError, match=r"'Hh' \(did you mean 'H'\?\)"):
        DiLoCoStrategy(Hh=3)
    # With a full OptimSpec, its options belong inside it.
    with pytest.raises(TypeError, match=r"options of SGD go inside the OptimSpec"):
        SPARTAStrategy(OptimSpec(torch.optim.SGD, lr=0.05), momentum=0.9)
