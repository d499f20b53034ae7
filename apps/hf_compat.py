"""Workarounds needed to run the transformers 5.23 Gemma 4 reference (fixture generation, the
demo-pair recipe). Not used by inference; transformers is imported only when called.

    python apps/hf_compat.py [--patched]

checks the installed transformers for the bugs `patch_kv_sharing_modes` works around: exit status 0
when its `kv_sharing_modes` are right, 1 when the patch is needed, 2 without transformers.
"""

import argparse
import sys


def patch_kv_sharing_modes() -> None:
    """Fix `Gemma4TextConfig.kv_sharing_modes` in transformers 5.23.0 (idempotent).

    The property decides, per layer, whether it computes its own K/V (None), computes them and
    also publishes them in `shared_kv_states` ("store"), or reads another layer's K/V ("reuse").
    Two bugs in 5.23.0:
      1. If every layer is shared (num_kv_shared_layers == num_hidden_layers, which
         Gemma4AssistantConfig.__post_init__ forces for every assistant), the producer set is
         empty and it raises ValueError("The set of layer types producing a cache is different
         than the set of layer types using them"): no Gemma4AssistantForCausalLM can be built.
         Correct: every layer "reuse"s the K/V the target hands in.
      2. If no layer is shared (31B / 26B-A4B-like targets) it returns all None, so no layer is
         "store", `return_shared_kv_states` yields {} and assisted generation dies with
         KeyError 'full_attention'. Correct (the code comment's intent, and an earlier upstream
         version): the last layer of each layer type is "store".
    For 0 < num_kv_shared_layers < num_hidden_layers (E2B/E4B-like) the original is used.
    """
    from transformers import Gemma4TextConfig

    if getattr(Gemma4TextConfig, "_mlx_mtp_patched", False):
        return
    original = Gemma4TextConfig.kv_sharing_modes

    def modes(self):
        n, shared = self.num_hidden_layers, self.num_kv_shared_layers or 0
        if n and shared >= n:  # bug 1: an assistant reuses the target's K/V everywhere
            return ["reuse"] * n
        if shared == 0:  # bug 2: the last layer of each type publishes its K/V
            out = [None] * n
            for kind in set(self.layer_types):
                out[max(i for i, t in enumerate(self.layer_types) if t == kind)] = "store"
            return out
        return original.fget(self)

    Gemma4TextConfig.kv_sharing_modes = property(modes)
    Gemma4TextConfig._mlx_mtp_patched = True


def expected_modes(layer_types: list, shared: int) -> list:
    """What `kv_sharing_modes` should be: all "reuse" when every layer is shared (an assistant),
    "store" at the last layer of each type when none is (the original is trusted in between)."""
    n = len(layer_types)
    if shared >= n:
        return ["reuse"] * n
    last = {kind: i for i, kind in enumerate(layer_types)}
    return ["store" if last[kind] == i else None for i, kind in enumerate(layer_types)]


TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2  # a probe config's layers
PROBES = (("every layer shared (an assistant)", len(TYPES)), ("no layer shared (a 31B-like target)", 0))


def check(patched: bool = False) -> list:
    """(what, the modes or the error, right) of the PROBES: an assistant's config and a target's."""
    from transformers import Gemma4TextConfig

    if patched:
        patch_kv_sharing_modes()
    found = []
    for what, shared in PROBES:
        config = Gemma4TextConfig(num_hidden_layers=len(TYPES), layer_types=TYPES,
                                  num_kv_shared_layers=shared)
        try:
            modes = config.kv_sharing_modes
        except ValueError as e:
            modes = f"ValueError: {e}"
        found.append((what, modes, modes == expected_modes(TYPES, shared)))
    return found


def main(argv=None) -> int:
    what = "Check the installed transformers' Gemma4TextConfig.kv_sharing_modes for the bugs patched here."
    ap = argparse.ArgumentParser(prog="python apps/hf_compat.py", description=what)
    ap.add_argument("--patched", action="store_true",
                    help="check it with patch_kv_sharing_modes() applied, as the fixture and demo-pair "
                         "scripts run it (default: off, the installed transformers as it is)")
    args = ap.parse_args(argv)
    try:
        import transformers
    except ImportError:
        print("error: transformers is not installed (pip install transformers)", file=sys.stderr)
        return 2
    found = check(args.patched)
    print(f"transformers {transformers.__version__}{', patched' if args.patched else ''}: kv_sharing_modes")
    for what, modes, right in found:
        print(f"  {what}: {modes} ({'right' if right else 'wrong'})")
    if all(right for _, _, right in found):
        print("all right")
        return 0
    print("wrong even patched" if args.patched else "the patch is needed")
    return 1


if __name__ == "__main__":
    sys.exit(main())
