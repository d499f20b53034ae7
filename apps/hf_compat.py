"""Workarounds needed to run the transformers 5.23 Gemma 4 reference (fixture generation, the
demo-pair recipe). Not used by inference; transformers is imported only when called."""


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
