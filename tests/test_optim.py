
import pytest
import torch

from posttrain.config.schema import TrainerConfig
from posttrain.data.sampler import EpochSampler
from posttrain.optim import build_optimizer, lr_multiplier


def test_warmup_then_cosine_by_hand():
    cfg = TrainerConfig(max_steps=12, warmup_steps=2, lr_scheduler="cosine", min_lr_ratio=0.1)
    # Warm-up: steps 0, 1 get 1/2, 2/2. Decay runs over steps 2..11 (9 intervals) from 1 to 0.1.
    assert lr_multiplier(0, cfg) == pytest.approx(0.5)
    assert lr_multiplier(1, cfg) == pytest.approx(1.0)
    assert lr_multiplier(2, cfg) == pytest.approx(1.0)
    # Step 5: progress 3/9, cosine shape 0.5 * (1 + cos(pi/3)) = 0.75, so 0.1 + 0.9 * 0.75.
    assert lr_multiplier(5, cfg) == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_multiplier(11, cfg) == pytest.approx(0.1)


def test_linear_and_constant():
    linear = TrainerConfig(max_steps=11, lr_scheduler="linear")
    assert [lr_multiplier(s, linear) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    constant = TrainerConfig(max_steps=5, warmup_steps=4, lr_scheduler="constant")
    assert [lr_multiplier(s, constant) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    optimizer = build_optimizer(model, TrainerConfig(weight_decay=0.1))
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decays[id(model[0].weight)] == 0.1
    assert decays[id(model[0].bias)] == decays[id(model[1].weight)] == decays[id(model[1].bias)] == 0.0


def test_sampler_covers_each_epoch_and_resumes_exactly():
    sampler = EpochSampler(10, seed=3)
    first_epoch = sampler.next_indices(10)
    assert sorted(first_epoch) == list(range(10))
    drawn = sampler.next_indices(7)
    state = sampler.state_dict()
    rest = sampler.next_indices(9)
    resumed = EpochSampler(10, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_indices(9) == rest
    assert sorted(drawn + rest[:3]) == list(range(10))  # the second epoch is a permutation too
    assert drawn + rest[:3] != first_epoch
    with pytest.raises(ValueError, match="taken over 10 training examples but the data now has 11"):
        EpochSampler(11, seed=3).load_state_dict(state)
