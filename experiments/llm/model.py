"""The models: a Hugging Face causal LM from a local directory (the paper's Llamas), or a small Llama
built from a LlamaConfig (the CPU analogue's base, no download); LoRA as in the paper's tables."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

BASE_QUALITY = "base_quality.json"   # a pretrained base's held-out greedy accuracy and NLL, saved beside its weights
WEIGHT_FILES = ("*.safetensors", "*.bin")   # what a base's identity hashes (not its configs or tokenizer)


def base_identity(path) -> dict:
    """Which base a fine-tune started from, for its summary.json: the SHA-256 of the weight files (sorted by
    name; the first 16 hex digits) and the base's quality record where pretraining wrote one. Two bases
    pretrained from one config are not bitwise equal (results/pretrain_arith/README.md), and the SFT analogue's
    verdict moved with the base (results/sft_arith/README.md): runs of one table must share this."""
    root, digest = Path(path), hashlib.sha256()
    files = sorted(f for pattern in WEIGHT_FILES for f in root.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_FILES)}) in the base model directory {root}")
    for f in files:
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    quality = root / BASE_QUALITY
    return {"weights_sha256": digest.hexdigest()[:16], "files": len(files),
            **({"quality": json.loads(quality.read_text())} if quality.exists() else {})}


def load_tokenizer(path):
    """The tokenizer and its chat template; a pad token is only ever used under IGNORE labels, so a
    tokenizer without one (Llama 3) pads with its EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.chat_template is None:
        raise ValueError(f"the tokenizer at {path} has no chat template; the paper formats SFT data with the "
                         "Instruct model's template (task.model.tokenizer=<...-Instruct>)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path, dtype: str, attn_implementation: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype),
                                                attn_implementation=attn_implementation)


def small_llama(arch, tokenizer):
    """A Llama from `arch` (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    num_key_value_heads, max_position_embeddings, tie_word_embeddings), randomly initialised."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **dict(arch))
    return LlamaForCausalLM(config)


def add_lora(model, lora):
    """peft LoRA: rank r, scale alpha, dropout, bias none, on `target_modules` ("all-linear": every
    linear layer but the output head). `modules_to_save: [embed_tokens]` also trains the token
    embeddings (the 3B run); tied input and output embeddings stay tied."""
    import peft

    save = list(lora.modules_to_save or [])
    config = peft.LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM",
        target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
        modules_to_save=save or None, ensure_weight_tying=bool(save) and model.config.tie_word_embeddings)
    model = peft.get_peft_model(model, config)
    if save and model.config.tie_word_embeddings:
        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        if emb.weight is not head.weight:
            raise RuntimeError("LoRA broke the tie between input embeddings and output head")
    return model


def gradient_checkpointing(model, mode: str) -> None:
    """mode: "none", "reentrant" (the paper's 8B run) or "non_reentrant"."""
    if mode == "none":
        return
    if mode not in ("reentrant", "non_reentrant"):
        raise ValueError(f"Invalid gradient_checkpointing: {mode!r} (choose none, reentrant, non_reentrant)")
    kwargs = {"use_reentrant": mode == "reentrant"}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5 renamed it
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    model.config.use_cache = False


def packed_forward(model, batch: dict, **kwargs):
    """The forward of a packed batch (data.pack): position ids restart at every example and no
    attention mask is passed, from which Hugging Face builds the block-diagonal causal mask (or
    FlashAttention's variable-length call). use_cache=False: with a KV cache it skips that mask
    and every token would attend to the earlier examples of its block."""
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, **kwargs)
