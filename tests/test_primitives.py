"""Issue 42: primitives counted per path, projections joined at load, and no compile in a warmed run."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_mtp.runtime import jit
from mlx_mtp.selftest import primitives
from mlx_mtp.decode.batch import BatchGenerator
from mlx_mtp.loading import model_from_weights
from mlx_mtp.models import gemma4
from mlx_mtp.models.quantized import QuantizedLinear
from mlx_mtp.selftest.tiny import quantized_pair, tiny_pair
from mlx_mtp.selftest.warm import every_length


@pytest.fixture(scope="module")
def dense():
    return tiny_pair("dense", seed=5)


def total(kinds) -> int:
    return sum(kinds.values())


def test_counts_are_the_same_every_time_and_the_fused_path_has_fewer(dense):
    counts = {}
    for name in primitives.PATHS:
        with primitives.path(name):
            counts[name] = [total(primitives.round_kinds(dense.target, dense.drafter, rows, k))
                            for rows, k in ((1, 0), (1, 3), (4, 0))]
            again = [total(primitives.round_kinds(dense.target, dense.drafter, rows, k))
                     for rows, k in ((1, 0), (1, 3), (4, 0))]
            assert again == counts[name]
    cpu, metal = counts["cpu"], counts["metal"]
    assert all(m < c for m, c in zip(metal, cpu)), counts  # one node per mx.fast op: fewer than the CPU's ops
    assert all(c[1] > c[0] for c in counts.values())  # a round drafts and verifies: more than a step


def test_a_drafter_step_after_the_first_repeats_nothing_made_once_per_round(dense):
    """On the CPU, the K/V's transposes, the masks (as the scores' addend) and RoPE tables are made once per
    round: a third draft adds one drafter step's products, norms and per-layer ops, no transpose, broadcast or
    new axis."""
    with primitives.path("cpu"):
        step = primitives.round_kinds(dense.target, dense.drafter, 1, 3)
        step.subtract(primitives.round_kinds(dense.target, dense.drafter, 1, 2))
    layers = dense.drafter.config.text.num_hidden_layers
    # q, o, gate/up, down, scores, values a layer; in, out, head
    assert step["Matmul"] + step["AddMM"] == 6 * layers + 3
    assert step["AddMM"] == layers  # the scores take the round's mask as their addend: no select a layer
    assert step["Transpose"] == step["Broadcast"] == step["ExpandDims"] == 0, step
    assert step["Reshape"] == 2 * layers + 1, step  # q's heads, attention's output; the drafted token


def test_a_counted_graph_leaves_the_real_forward_alone(dense):
    """Counting traces its stand-ins apart: the model's own outputs afterwards are the same."""
    ids = mx.array([[5, 9, 11, 2]])
    before = dense.target(ids).logits
    with primitives.path("metal"):
        primitives.round_kinds(dense.target, dense.drafter, 1, 2)
    assert mx.array_equal(dense.target(ids).logits, before)


def test_the_cuda_path_stands_in_mlx_mtps_kernels():
    from mlx_mtp.kernels import dispatch

    pair = quantized_pair()
    dispatch.decisions.clear()
    with primitives.path("cuda"):
        cuda = primitives.round_kinds(pair.target, pair.drafter, 1, 0)
    ours = {family for family, kernel in dispatch.decisions if kernel == dispatch.OURS}
    dispatch.decisions.clear()
    with primitives.path("metal"):
        metal = primitives.round_kinds(pair.target, pair.drafter, 1, 0)
    # the products on mlx_mtp's kernels instead of MLX's quantized matmuls, the norms, RoPE, GLUs and
    # residual adds fused into issue 42's kernels
    assert cuda["QuantizedMatmul"] < metal["QuantizedMatmul"]
    assert {"attention input", "MLP input", "experts input", "residual", "router"} <= ours
    assert sum(cuda.values()) < sum(metal.values())


@pytest.mark.parametrize("rows", [1, 3])
def test_an_moe_layer_on_the_cuda_path_is_ten_kernels_and_its_kv_writes(rows):
    """Issue 42's target, <= 14 nodes an MoE layer: attention's input, attention, o, the glue, the MLP's input
    and down, the router (norm, scores, top-k, softmax, expert scales), the experts' input and down, the glue
    with the experts' weighted sum; and the K and V writes. Nothing is left to MLX's ops (the router's top-k
    and the weighted sum were 17 nodes)."""
    target = quantized_pair().target
    cache = primitives.filled_cache(target, rows, 16)
    step = cache.begin(1)
    x = mx.zeros((rows, target.config.hidden_size), mx.bfloat16)
    mx.eval(step.positions, step.masks, x)
    with primitives.path("cuda"):
        for layer in target.model.layers:
            h, kv = layer(x, step)
            assert primitives.node_kinds(h, *kv) == {primitives.STAND_IN: 10, "DynamicSliceUpdate": 2}


@pytest.mark.parametrize("bits", [0, 4])
@pytest.mark.parametrize("tokens,fewer", [(3, 8), (40, 3)])  # 6 pairs; 80: mlx-lm sorts the rows by expert
def test_the_gpus_experts_are_mlx_lms_switch_glu_bitwise_in_fewer_nodes(bits, tokens, fewer):
    """MLX's gather products with their row indices handed in as constants: the same products of the same rows
    (the output bitwise), without the Arange that makes them (and its reshape and broadcast, rows unsorted)."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_mtp.models import moe
    from mlx_mtp.models.quantized import gathered_glu

    glu = SwitchGLU(64, 32, 6, moe.GeGLU())
    for name, p in (("gate_proj", glu.gate_proj), ("up_proj", glu.up_proj), ("down_proj", glu.down_proj)):
        p.weight = mx.random.normal(p.weight.shape, key=mx.random.key(len(name))) / 8
    if bits:
        nn.quantize(glu, group_size=32, bits=bits)
    dtype = mx.bfloat16 if bits else mx.float32  # (MLX's CPU gather_mm takes float32 only)
    x = mx.random.normal((tokens, 64), key=mx.random.key(7)).astype(dtype)
    glu.set_dtype(dtype)
    idx = mx.array(np.random.default_rng(tokens).integers(0, 6, (tokens, 2)), dtype=mx.uint32)
    mx.eval(glu.parameters(), x, idx)
    want, got = glu(x, idx), gathered_glu(glu, x, idx)
    assert total(primitives.node_kinds(want)) - total(primitives.node_kinds(got)) == fewer
    assert "Arange" not in primitives.node_kinds(got)
    assert got.shape == (tokens, 2, 64) and mx.array_equal(got, want)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_joined_checkpoints_and_the_checkpoint_layout_load_the_same(variant):
    """sanitize joins q/k/v, gate/up and the experts' gate/up (idempotent); unjoin writes the checkpoint's
    layout back."""
    target = tiny_pair(variant, seed=5).target
    config = {"model_type": "gemma4_text", **target.config.__dict__}
    config.pop("per_layer_config", None)
    params = dict(tree_flatten(target.parameters()))
    layout = gemma4.unjoin(params, target.model.layers)
    assert "model.layers.0.self_attn.q_proj.weight" in layout and "model.layers.0.mlp.up_proj.weight" in layout
    if variant == "moe":
        glu = "model.layers.0.experts.switch_glu."
        cfg = target.config
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        assert layout[glu + "gate_proj.weight"].shape == layout[glu + "up_proj.weight"].shape == (E, I, H)
    assert not any("qkv_proj" in k or "gate_up_proj" in k for k in layout)
    rejoined = gemma4.join(layout)
    assert rejoined.keys() == params.keys() and all(mx.array_equal(rejoined[k], params[k]) for k in params)
    assert gemma4.join(rejoined).keys() == params.keys()  # idempotent
    ids = mx.array([[3, 7, 1, 8, 2]])
    old = model_from_weights(config, layout)
    assert mx.array_equal(old(ids).logits, target(ids).logits)


@pytest.mark.parametrize("fused", [False, True])  # the CPU's experts grouped by expert; MLX's gather products
def test_the_experts_joined_gate_up_give_their_parts_outputs_bitwise(fused):
    """Each expert's gate rows then its up rows in one (E, 2I, H) projection (quantized: groups along the input
    axis, so the join is exact): the experts' outputs bitwise those of mlx-lm's SwitchGLU with the parts."""
    from mlx_lm.models.switch_layers import SwitchGLU

    from mlx_mtp.models import layout, moe
    from mlx_mtp.models.base import force_fused
    from mlx_mtp.models.quantized import adopt, switch_glu

    apart, joined = SwitchGLU(64, 32, 6, moe.GeGLU()), moe.SwitchGLU(64, 32, 6, moe.GeGLU())
    for i, p in enumerate((apart.gate_proj, apart.up_proj, apart.down_proj)):
        p.weight = mx.random.normal(p.weight.shape, key=mx.random.key(20 + i)) / 8
    for glu in (apart, joined):
        nn.quantize(glu, group_size=32, bits=4)
        adopt(glu)
    prefix = "layers.0.experts.switch_glu."  # as a checkpoint names them
    parts = {prefix + k: v for k, v in tree_flatten(apart.parameters())}
    joined.update(tree_unflatten([(k[len(prefix):], v) for k, v in layout.join(parts).items()]))
    assert joined.gate_up_proj.weight.shape[:2] == (6, 64)
    x = mx.random.normal((5, 64), key=mx.random.key(30)).astype(mx.bfloat16)
    idx = mx.array(np.random.default_rng(1).integers(0, 6, (5, 2)), dtype=mx.uint32)
    with force_fused(fused):
        want, got = switch_glu(apart, x, idx), switch_glu(joined, x, idx)
    assert got.shape == (5, 2, 64) and mx.array_equal(got, want)


def test_a_joined_quantized_product_is_its_parts_bitwise():
    """Quantization groups run along the input axis: joining along the output axis is exact, and the
    quantized kernel computes each output column alone, so each part's columns are bitwise its own."""
    parts = [nn.Linear(64, n, bias=False) for n in (32, 16, 16)]
    for p, seed in zip(parts, (1, 2, 3)):
        p.weight = mx.random.normal(p.weight.shape, key=mx.random.key(seed)) / 8
    joined = nn.Linear(64, 64, bias=False)
    joined.weight = mx.concatenate([p.weight for p in parts])
    q_parts = [nn.QuantizedLinear.from_linear(p, group_size=32, bits=4) for p in parts]
    q_joined = nn.QuantizedLinear.from_linear(joined, group_size=32, bits=4)
    for q in (*q_parts, q_joined):
        q.__class__ = QuantizedLinear
    x = mx.random.normal((3, 64), key=mx.random.key(4))
    want = mx.concatenate([q(x) for q in q_parts], axis=-1)
    assert mx.array_equal(q_joined(x), want)


def run(pair, prompts, k, n=10) -> list:
    gen = BatchGenerator(pair.target, pair.drafter, draft_tokens=k)
    uids = [gen.insert(p, max_tokens=n) for p in prompts]
    out = {u: [] for u in uids}
    while gen.busy:
        for event in gen.step():
            out[event.uid] += event.tokens
    return [out[u] for u in uids]


def test_auto_compiles_nothing_once_every_draft_length_is_warmed():
    """Warm-up runs each draft length auto may pick, and plain steps and drafted rounds in turn, at the
    batch's shapes; the auto runs after it trace nothing new (without the warm-up they do: the counter
    sees it)."""
    prompts = [np.random.default_rng(i).integers(3, 128, 12 + i).tolist() for i in range(2)]
    cold = tiny_pair("dense", seed=7)
    with jit.counting() as traced:
        run(cold, prompts, "auto")
    assert traced.count > 0
    warm = tiny_pair("dense", seed=7)
    every_length(prompts, warm, 10)
    with jit.counting() as traced:
        tokens = run(warm, prompts, "auto")
    assert traced.count == 0, traced.signatures
    assert tokens == run(warm, prompts, 0)  # and auto's output is plain greedy decoding's


def test_compiled_forwards_read_the_weights_the_model_has_now():
    """Products read transposed views of their weights handed to the compiled forward: made again when a
    weight changes, and found again when a layer is replaced (here: quantized after the first forward)."""
    from mlx_mtp.models.quantized import adopt

    mine, other = tiny_pair("dense", seed=11).target, tiny_pair("dense", seed=12).target
    ids = mx.array([[5], [9]])

    def step(model):  # a decoding step: the compiled forward
        return model(ids, primitives.filled_cache(model, 2, 16)).logits

    first = step(mine)
    mine.update(other.parameters())
    assert mx.array_equal(step(mine), step(other)) and not mx.array_equal(step(mine), first)
    for model in (mine, other):
        nn.quantize(model, group_size=32, bits=4, class_predicate=lambda path, m: path.endswith("mlp.down_proj"))
        adopt(model)
    assert mx.array_equal(step(mine), step(other))


def test_a_record_quantizing_the_parts_of_a_joined_projection_apart_is_refused(dense):
    from mlx_mtp.loading import apply_quantization
    from mlx_mtp.models.base import ConfigError

    record = {"group_size": 32, "bits": 4, "model.layers.0.mlp.gate_proj": {"group_size": 32, "bits": 8},
              "model.layers.0.mlp.up_proj": {"group_size": 32, "bits": 8}}
    model = gemma4.Model(dense.target.config)
    apply_quantization(model, record, gemma4)  # both parts at 8 bits: the joined module is
    assert model.model.layers[0].mlp.gate_up_proj.bits == 8 and model.model.layers[1].mlp.gate_up_proj.bits == 4
    record["model.layers.0.mlp.up_proj"] = {"group_size": 32, "bits": 4}
    with pytest.raises(ConfigError, match="gate_up_proj are quantized differently"):
        apply_quantization(gemma4.Model(dense.target.config), record, gemma4)
