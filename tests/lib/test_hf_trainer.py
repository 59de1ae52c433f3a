"""A Hugging Face Trainer accepts DoPr through optimizers=(opt, scheduler)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import dopr  # noqa: E402


def test_trainer_steps_with_dopr(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(cfg)
    opt = dopr.build(model, "adamw", ap={"damping": 1e-4}, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    cov = {e.name: e for e in opt.coverage()}
    assert cov["model.layers.0.self_attn.q_proj"].status == "preconditioned"
    assert cov["model.embed_tokens"].mode == "embedding-diagonal"
    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": t, "labels": t} for t in torch.randint(0, 64, (16, 12), generator=g)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          report_to=[], save_strategy="no", logging_steps=1, use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
    before = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    trainer.train()
    st = opt.stats()
    assert st["steps"] == 3 and st["preconditioned"] > 0 and st["no_forward"] == []
    assert not torch.equal(before, model.model.layers[0].self_attn.q_proj.weight)
    # q, k, v read the same normed hidden states: one factorisation for the three
    per_step = st["factorizations"] / 3
    n_layers = sum(e.status == "preconditioned" for e in opt.coverage())
    assert per_step <= n_layers - 2 * cfg.num_hidden_layers
