"""The mid bench pair (apps/bench/pairs.py): shape, drafter ratio, seed determinism."""

import mlx.core as mx

from apps.bench import pairs
from mlx_mtp.models import model_module


def test_mid_pair_shape_and_seed_determinism():
    def lazy(cfg):  # parameters stay unevaluated: counting them costs nothing
        module = model_module(cfg["model_type"])
        return module.Model(module.Config.from_dict(cfg))

    target, drafter = lazy(pairs.MID_TARGET), lazy(pairs.MID_DRAFTER)
    nt, nd = pairs.n_params(target), pairs.n_params(drafter)
    assert 250e6 < nt < 350e6 and 0.03 < nd / nt < 0.05, (nt, nd)
    drafter.check_target(target)  # reads the target's store-layer K/V and hidden state

    small = dict(pairs.MID_TARGET, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 layer_types=pairs.MID_TARGET["layer_types"][:6], vocab_size=256)
    a, b, c = pairs.build(small, 3), pairs.build(small, 3), pairs.build(small, 4)
    wa, wb, wc = (m.model.layers[0].mlp.gate_up_proj.weight for m in (a, b, c))
    assert mx.array_equal(wa, wb) and not mx.array_equal(wa, wc)
