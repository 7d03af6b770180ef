"""TEST-ONLY: pretend a newer transformers is installed, optionally one whose Llama loss changed.

Put on PYTHONPATH by tests/test_e2e_versions.py. ``NEWER_LIBRARY_VERSION`` (e.g. ``5.99.0``) is what
``importlib.metadata.version("transformers")`` reports. With ``NEWER_LIBRARY_CHANGES_LOSS=1`` the class forward of
``LlamaForCausalLM`` halves its logits before the loss (as a release that added a logit scale to the family would):
the plugin's families data does not know it, so only the first-step guard can catch it. Never used outside tests/.
"""

import functools
import importlib.metadata
import os

_FAKE = os.environ.get("NEWER_LIBRARY_VERSION")
if _FAKE:
    _version = importlib.metadata.version

    @functools.wraps(_version)
    def version(name):
        return _FAKE if name == "transformers" else _version(name)

    importlib.metadata.version = version

if os.environ.get("NEWER_LIBRARY_CHANGES_LOSS") == "1":
    from transformers.models.llama import modeling_llama

    _forward = modeling_llama.LlamaForCausalLM.forward

    @functools.wraps(_forward)
    def forward(self, *args, labels=None, **kwargs):
        out = _forward(self, *args, labels=None, **kwargs)
        out.logits = out.logits * 0.5
        if labels is not None:
            extra = {k: v for k, v in kwargs.items() if k == "num_items_in_batch"}
            out.loss = self.loss_function(logits=out.logits, labels=labels, vocab_size=self.config.vocab_size, **extra)
        return out

    modeling_llama.LlamaForCausalLM.forward = forward
    print("[newer_library_shim] LlamaForCausalLM.forward halves its logits before the loss", flush=True)
