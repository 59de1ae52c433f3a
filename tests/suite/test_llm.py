"""Language-model SFT pipeline (experiments/llm): labels, packing, \\boxed{} extraction, LoRA + DoPr,
lm-eval invocation, missing inputs, sharding, and a tiny pretrain -> SFT -> generation run on CPU."""
import copy
import hashlib
import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("hydra")
from omegaconf import OmegaConf, open_dict  # noqa: E402

import dopr  # noqa: E402
from experiments.common import build_optimizer  # noqa: E402
from experiments.common.launch import run_job  # noqa: E402
from experiments.llm import arith, evaluate, train  # noqa: E402
from experiments.llm.data import IGNORE, encode_example, encode_prompt, pack  # noqa: E402
from experiments.llm.model import add_lora, gradient_checkpointing, packed_forward, small_llama  # noqa: E402
from experiments.llm.sources import MissingResource  # noqa: E402

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": True}
LORA_8B = OmegaConf.create({"r": 4, "alpha": 8, "dropout": 0.0, "target_modules":
                            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                            "modules_to_save": []})



@pytest.fixture(scope="module")
def tok():
    return arith.char_tokenizer()


def _examples(tok, n, seed=0, max_steps=2):
    ps = arith.word_problems(n, seed, 1, max_steps, 999, 99)
    return [encode_example(tok, p["problem"], p["generated_solution"], "Solve.", 512) for p in ps], ps


# ------------------------------------------------------------------------------------ data
def test_arithmetic_solutions_are_right_and_end_in_boxed_answer():
    assert arith.column_addition(347, 58) == ("347+58: 7+8=15, 4+5+1=10, 3+0+1=4, so 405.", 405)
    assert arith.column_subtraction(405, 19) == ("405-19: 15-9=6, 10-1-1=8, 4-0-1=3, so 386.", 386)
    for p in arith.word_problems(200, 3, 2, 4, 999, 99):
        value = int(p["problem"].split(" has ")[1].split()[0])
        for line in p["generated_solution"].splitlines()[:-1]:  # each line starts from the last result
            head, result = line.split(":")[0], int(line.rsplit("so ", 1)[1].rstrip("."))
            a, op, b = (head.partition("+") if "+" in head else head.partition("-"))
            assert int(a) == value and result == (int(a) + int(b) if op == "+" else int(a) - int(b))
            value = result
        assert p["generated_solution"].endswith(f"\nThe answer is \\boxed{{{value}}}.")
        assert p["expected_answer"] == str(value)
        assert 0 <= value <= 999


def test_pretraining_documents_spell_every_character_the_sft_answer_needs(tok):
    """The base must have produced '{' and '}' (LoRA on the blocks cannot teach a new output character
    through tied embeddings), and the pretraining answer parser reads the document's own answer."""
    from experiments.llm.pretrain import first_answer

    for p in arith.word_problems(50, 4, 1, 3, 999, 99):
        doc = arith.pretraining_document(p)
        assert first_answer(doc) == p["expected_answer"]
        assert tok.unk_token_id not in tok(doc, add_special_tokens=False)["input_ids"]
        assert set(p["generated_solution"]) <= set(doc)  # every character of the SFT target, braces included
    assert first_answer("The answer is 12.") is None and first_answer("The answer is \\boxed{7}.") == "7"


def test_only_completion_tokens_carry_labels(tok):
    p = arith.word_problems(1, 0, 2, 2, 999, 99)[0]
    ex = encode_example(tok, p["problem"], p["generated_solution"], "Solve.", 512)
    prompt = encode_prompt(tok, p["problem"], "Solve.")
    assert ex["input_ids"][:len(prompt)] == prompt
    assert ex["labels"][:len(prompt)] == [IGNORE] * len(prompt)
    completion = ex["labels"][len(prompt):]
    assert IGNORE not in completion and completion == ex["input_ids"][len(prompt):]
    assert tok.decode(completion) == p["generated_solution"] + "<|end|>"  # the turn's end is learned (EOS)
    assert "Solve." in tok.decode(prompt) and p["problem"] in tok.decode(prompt)


def test_a_template_that_does_not_render_the_prompt_as_a_prefix_is_refused(tok):
    bad = arith.char_tokenizer()
    bad.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    with pytest.raises(ValueError, match="prefix"):
        encode_example(bad, "1+1?", "2", "Solve.", 64)


def test_packing_fills_blocks_and_restarts_positions(tok):
    exs, _ = _examples(tok, 12)
    blocks = pack(exs, 512, tok.pad_token_id)
    assert blocks["input_ids"].shape[1] == 512 and len(blocks["input_ids"]) < len(exs)
    found = []
    for ids, labels, pos in zip(blocks["input_ids"], blocks["labels"], blocks["position_ids"]):
        starts = [i for i in range(512) if pos[i] == 0] + [512]
        for s, e in zip(starts, starts[1:]):
            assert list(pos[s:e]) == list(range(e - s)) and labels[s] == IGNORE
            if ids[s] != tok.pad_token_id:
                found.append(list(ids[s:e]))
            else:
                assert (labels[s:e] == IGNORE).all()  # the padding tail is a segment with no labels
    assert sorted(found) == sorted(e["input_ids"] for e in exs)  # every example whole, none split
    single = pack(exs, 512, tok.pad_token_id, packing=False)
    assert len(single["input_ids"]) == len(exs)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_examples_do_not_attend_to_each_other(tok, attn):
    exs, _ = _examples(tok, 2)
    blocks = pack(exs, 512, tok.pad_token_id)
    assert len(blocks["input_ids"]) == 1
    torch.manual_seed(0)
    model = small_llama({**TINY, "max_position_embeddings": 512}, tok).eval()
    model.config._attn_implementation = attn
    packed = packed_forward(model, {k: torch.from_numpy(v) for k, v in blocks.items()}).logits[0]
    offset = 0
    for ex in exs:
        n = len(ex["input_ids"])
        alone = model(input_ids=torch.tensor([ex["input_ids"]])).logits[0]
        torch.testing.assert_close(packed[offset:offset + n], alone, rtol=1e-4, atol=1e-4)
        offset += n
    # the check can fail: with a KV cache (use_cache=True, the HF default) the same position ids do
    # not separate the examples, and the second one reads the first
    n0 = len(exs[0]["input_ids"])
    leaky = model(input_ids=torch.from_numpy(blocks["input_ids"]),
                  position_ids=torch.from_numpy(blocks["position_ids"])).logits[0]
    assert (leaky[n0:n0 + len(exs[1]["input_ids"])] - packed[n0:n0 + len(exs[1]["input_ids"])]).abs().max() > 1e-2


# ------------------------------------------------------------------------------ evaluation
def test_boxed_answer_extraction_handles_nesting_and_missing_boxes():
    assert evaluate.extract_boxed("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert evaluate.extract_boxed("\\boxed{1} then \\boxed{{a}{b}}") == "{a}{b}"  # the last box
    assert evaluate.extract_boxed("\\boxed{\\sqrt{\\frac{3}{4}}}") == "\\sqrt{\\frac{3}{4}}"
    assert evaluate.extract_boxed("the answer is 42") is None
    assert evaluate.extract_boxed("\\boxed{\\frac{1}{2}") is None  # never closed
    assert evaluate.normalize_answer(" 1,234. ") == "1234"


class _Oracle(torch.nn.Module):
    """generate() writes the given completions after the prompt."""

    def __init__(self, tok, completions):
        super().__init__()
        self.tok, self.completions = tok, completions

    def generate(self, input_ids, attention_mask, **kw):
        done = [self.tok(c, add_special_tokens=False)["input_ids"] for c in self.completions[:len(input_ids)]]
        self.completions = self.completions[len(input_ids):]
        width = max(map(len, done))
        tail = torch.tensor([d + [self.tok.pad_token_id] * (width - len(d)) for d in done])
        return torch.cat([input_ids, tail], 1)


def test_generation_exact_match_counts_boxed_answers(tok):
    prompts = [encode_prompt(tok, p, "Solve.") for p in ("a", "bb", "ccc", "d")]
    outs = ["x\n\\boxed{12}<|end|>", "\\boxed{7}", "no box", "\\boxed{{5}}"]
    res = evaluate.generation_accuracy(_Oracle(tok, outs), tok, prompts, ["12", "8", "3", "{5}"],
                                       evaluate.extract_boxed, 8, 3, "cpu")
    assert res["accuracy"] == 0.5 and res["answered_fraction"] == 0.75
    assert res["accuracy_stderr"] == pytest.approx((0.25 / 3) ** 0.5)


def test_lm_eval_invocation_has_the_papers_tasks_shots_and_adapter(tmp_path, compose):
    t = compose("task=sft_llama31_8b").task
    cmds = evaluate.lm_eval_commands(t.eval.lm_eval, "/w/Llama-3.1-8B", "/run/adapter", "/run/adapter", tmp_path, 0)
    assert list(cmds) == ["gsm8k", "gsm8k_cot", "minerva_math500"]
    for task, shots in {"gsm8k": "5", "gsm8k_cot": "8", "minerva_math500": "4"}.items():
        argv = cmds[task]
        assert argv[argv.index("--tasks") + 1] == task and argv[argv.index("--num_fewshot") + 1] == shots
        assert argv[argv.index("--model") + 1] == "vllm"
        args = dict(kv.split("=", 1) for kv in argv[argv.index("--model_args") + 1].split(","))
        assert args["pretrained"] == "/w/Llama-3.1-8B" and args["lora_local_path"] == "/run/adapter"
        assert args["tensor_parallel_size"] == "8" and args["max_model_len"] == "8193"
        gen = dict(kv.split("=") for kv in argv[argv.index("--gen_kwargs") + 1].split(","))
        assert gen["temperature"] == "0.0" and gen["do_sample"] == "False" and gen["max_gen_toks"] == "2048"
        assert "--apply_chat_template" in argv and argv[argv.index("--output_path") + 1] == str(tmp_path / task)
    with open_dict(t):
        t.eval.lm_eval.backend = "hf"
    hf = evaluate.lm_eval_commands(t.eval.lm_eval, "/w/base", "/run/adapter", "/run/adapter", tmp_path, 0)["gsm8k"]
    assert "peft=/run/adapter" in hf[hf.index("--model_args") + 1]
    # the harness's results file: accuracy and standard error of the configured metric
    out = tmp_path / "gsm8k" / "model"
    out.mkdir(parents=True)
    (out / "results_2026.json").write_text(json.dumps({"results": {"gsm8k": {
        "exact_match,flexible-extract": 0.8, "exact_match_stderr,flexible-extract": 0.011,
        "exact_match,strict-match": 0.1, "exact_match_stderr,strict-match": 0.01}}}))
    assert evaluate.read_lm_eval(tmp_path / "gsm8k", "gsm8k", "exact_match,flexible-extract") == {
        "accuracy": 0.8, "accuracy_stderr": 0.011}


def test_report_rows_take_lm_eval_accuracies_and_the_peak_over_training():
    from experiments.llm.report import sweep_rows

    def summary(optim, lr, final, steps):
        res = lambda a: {"gsm8k": {"accuracy": a, "accuracy_stderr": 0.01}}
        return {"summary": {"optim": optim, "lr": lr, "val_nll": 0.5, "train_loss": 0.4, "lm_eval": res(final),
                            "lm_eval_steps": {k: res(v) for k, v in steps.items()}}}

    rows, benchmarks = sweep_rows([summary("adamw", 1e-4, 0.6, {100: 0.7, 200: 0.65}),
                                   summary("dopr_adamw", 1e-4, 0.8, {100: 0.5}),
                                   summary("adamw", 5e-4, 0.3, {100: 0.2})])
    assert benchmarks == ["gsm8k", "peak_gsm8k"]
    by = {(r["optimizer"], r["lr"]): r for r in rows}
    assert by[("adamw", 1e-4)]["gsm8k"] == 0.6 and by[("adamw", 1e-4)]["peak_gsm8k"] == 0.7
    assert by[("dopr_adamw", 1e-4)]["peak_gsm8k"] == 0.8 and by[("adamw", 1e-4)]["gsm8k_se"] == 0.01
    assert [by[("adamw", lr)]["lr_index"] for lr in (1e-4, 5e-4)] == [1, 2]



def test_report_refuses_to_average_two_settings_of_one_rate_as_seeds():
    from experiments.llm.report import sweep_rows

    run = lambda wd, seed: {"summary": {"optim": "adamw", "lr": 1e-2, "seed": seed, "weight_decay": wd,
                                        "val_nll": 0.05, "train_loss": 0.06, "accuracy": 0.1, "accuracy_stderr": 0.02}}
    with pytest.raises(ValueError, match="several runs with seed 0.*tuning select"):
        sweep_rows([run(0.01, 0), run(0.1, 0)])   # a tuning sweep: two weight decays on seed 0
    rows, _ = sweep_rows([run(0.1, 3), run(0.1, 4)])   # two seeds of one setting: averaged
    assert rows[0]["seeds"] == 2 and rows[0]["exact_match"] == pytest.approx(0.1, rel=1e-12)


def test_the_nll_axis_turns_logarithmic_when_one_rate_sits_ten_times_off_the_rest():
    from experiments.llm.report import nll_axis_scale

    # the committed sft_arith protocol: NLL 0.006-0.06 beside one diverged rate at 1.45
    assert nll_axis_scale([0.0063, 0.024, 0.06, 1.45]) == "log"
    assert nll_axis_scale([0.3, 0.5, 2.9]) == "linear"             # under 10x: a linear axis reads better
    assert nll_axis_scale([0.3, float("nan"), float("inf"), 0.4]) == "linear"   # non-finite points are not drawn
    assert nll_axis_scale([]) == "linear"

# ------------------------------------------------------------------- missing inputs, sharding
def test_missing_weights_data_and_eval_data_fail_before_any_model_is_loaded(tmp_path, monkeypatch, compose):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    cfg = compose("task=sft_llama31_8b", "+tuned/sft=dopr_adamw")
    with pytest.raises(MissingResource) as err:
        run_job(cfg, tmp_path / "run")
    msg = str(err.value)
    for item in ("meta-llama/Llama-3.1-8B'", "meta-llama/Llama-3.1-8B-Instruct", "nvidia/OpenMathInstruct-2",
                 "openai/gsm8k", "HuggingFaceH4/MATH-500", "task.model.path=", "hf download --repo-type dataset"):
        assert item in msg
    assert not (tmp_path / "run" / "summary.json").exists()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


def test_the_8b_preset_shards_with_fsdp2_and_bad_sharding_stops_with_the_clear_error(tmp_path, compose):
    assert compose("task=sft_llama31_8b").task.sharding == "fsdp"  # the paper sharded its 8B run (ZeRO-3)
    train.check_sharding(compose("task=sft_llama31_8b", "+tuned/sft=dopr_muon"))  # DoPr and Muon shard
    cfg = compose("task=sft_llama31_8b", "+tuned/sft=dopr_adamw", "task.sharding=zero3")
    with pytest.raises(ValueError, match="Invalid task.sharding: 'zero3'"):
        run_job(cfg, tmp_path / "run")  # before the weights are even looked for


def _run_in_process_group(cfg, out_dir, init_file):
    """run() as one rank of a gloo process group of size 1 (DDP or FSDP wrapping, collectives)."""
    import torch.distributed as dist

    from experiments.common.launch import apply_debug
    from experiments.common.run import Run

    apply_debug(cfg, out_dir)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        run = Run(cfg, out_dir)
        summary = run.finish(train.run(cfg, run))  # as run_job does: conventions and DoPr counters added
        run.close(False)
        return summary
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_data_parallel_dopr_with_reentrant_checkpointing_matches_the_single_process_run(tmp_path, compose):
    overrides = ["task=sft_llama31_8b", "+tuned/sft=dopr_adamw", "optim.lr=1e-2", "debug=default"]
    single = run_job(compose(*overrides), tmp_path / "single")
    ddp = _run_in_process_group(compose(*overrides), tmp_path / "ddp", tmp_path / "pg")
    assert compose(*overrides).task.model.gradient_checkpointing == "reentrant"  # and DDP's no_sync
    assert ddp["dopr"]["preconditioned"] == single["dopr"]["preconditioned"] > 0
    assert ddp["val_nll"] == pytest.approx(single["val_nll"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["dopr_adamw", "dopr_muon"])
def test_fsdp2_trains_dopr_as_the_unsharded_run_does(tmp_path, compose, optim):
    def cfg(*extra):
        c = compose("task=sft_arith", f"+tuned/sft={optim}", "debug=default", *extra)
        with open_dict(c):
            c.task.debug.eval.generation = None  # decoding runs on rank 0 alone: not under FSDP
        return c

    single = run_job(cfg(), tmp_path / "single")
    fsdp = _run_in_process_group(cfg("task.sharding=fsdp"), tmp_path / "fsdp", tmp_path / "pg")
    assert fsdp["steps"] == single["steps"] == 2
    assert fsdp["dopr"]["preconditioned"] == single["dopr"]["preconditioned"] > 0  # every LoRA matrix, sharded
    assert fsdp["val_nll"] == pytest.approx(single["val_nll"], rel=1e-5)
    saved = peft.PeftConfig.from_pretrained(str(tmp_path / "fsdp" / "adapter"))
    assert saved.r == 8 and saved.lora_alpha == 16


# --------------------------------------------------------------------------- LoRA and DoPr
def _one_batch(tok, n=3):
    exs, _ = _examples(tok, n)
    return {k: torch.from_numpy(v) for k, v in pack(exs, 512, tok.pad_token_id).items()}


def test_lora_with_dopr_updates_only_the_adapters_and_covers_every_one(tok, compose):
    torch.manual_seed(0)
    model = add_lora(small_llama(TINY, tok), LORA_8B)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all(".lora_A." in n or ".lora_B." in n for n in lora)
    cfg = compose("+tuned/sft=dopr_adamw", "optim.lr=1e-2")
    opt = build_optimizer(model, cfg)
    cov = {e.name: e for e in opt.coverage()}
    adapters = {n.rsplit(".", 1)[0] for n in lora}  # ...q_proj.lora_A.default
    assert len(adapters) == 2 * 7 * TINY["num_hidden_layers"]
    assert adapters <= set(cov) and all(cov[a].status == "preconditioned" for a in adapters)
    assert all(e.status == "skipped" and e.reason.startswith("frozen") for n, e in cov.items() if n not in adapters)
    b = _one_batch(tok)
    for _ in range(3):
        packed_forward(model, b, labels=b["labels"]).loss.backward()
        opt.step()
        opt.zero_grad()
    assert opt.stats()["preconditioned"] == 3 * len(adapters) and opt.stats()["no_forward"] == []
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in base.items())
    assert all(not torch.equal(after[n], p) for n, p in lora.items())


def test_3b_lora_trains_the_tied_embeddings_and_keeps_the_tie(tok, compose):
    t = compose("task=sft_llama32_3b").task
    assert t.lora.target_modules == "all-linear" and list(t.lora.modules_to_save) == ["embed_tokens"]
    model = add_lora(small_llama(TINY, tok), t.lora)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("embed_tokens" in n for n in trainable)
    assert not any("lm_head" in n and "lora_" in n for n in trainable)  # all-linear leaves the head out
    opt = dopr.build(model, "adamw", ap={}, lr=1e-2)
    emb = next(e for e in opt.coverage() if e.name.endswith("embed_tokens.modules_to_save.default"))
    assert emb.status == "skipped" and "tied" in emb.reason
    before = model.get_input_embeddings().weight.detach().clone()
    b = _one_batch(tok)
    packed_forward(model, b, labels=b["labels"]).loss.backward()
    opt.step()
    assert not torch.equal(before, model.get_input_embeddings().weight)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight


@pytest.mark.parametrize("sweep", ["sft_llama32_3b", "sft_llama32_3b_muon"])
def test_the_3b_sweeps_have_the_base_rate_and_the_papers_global_batch_on_one_gpu(compose, sweep):
    """Table sft_small_setup: base learning rate 1e-5, per-device batch 2 x 8 accumulation on (read as)
    the 8 GPUs of the LM runs = 128 packed sequences a step; one GPU per job gets 128 from 64 accumulation."""
    cfg = compose(f"sweep={sweep}", hydra_config=True)
    rates = [float(r) for r in str(cfg.hydra.sweeper.params["optim.lr"]).split(",")]
    assert min(rates) == 1e-5 and len(rates) == 9
    job = compose(f"sweep={sweep}", "+tuned/sft=adamw", "optim.lr=1e-5")
    tr, gpus = job.task.train, job.slurm.gpus_per_node * job.slurm.nodes
    assert job.task.name == "sft_llama32_3b" and not job.get("distributed", False)
    assert tr.micro_batch_size * tr.grad_accumulation * gpus == 128
    alone = compose("task=sft_llama32_3b").task.train      # the task keeps the paper's per-device values
    assert (alone.micro_batch_size, alone.grad_accumulation) == (2, 8)


def test_reentrant_checkpointing_gives_the_same_dopr_step_and_bf16_keeps_fp32_adapters(tok):
    b = _one_batch(tok)
    results = []
    for mode in ("none", "reentrant"):
        torch.manual_seed(0)
        model = add_lora(small_llama(TINY, tok), LORA_8B)
        for n, p in model.named_parameters():  # lora_B starts at zero: give A a gradient too
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
        gradient_checkpointing(model, mode)
        model.train()
        opt = dopr.build(model, "adamw", ap={}, lr=1e-2)
        packed_forward(model, b, labels=b["labels"]).loss.backward()
        opt.step()
        results.append(({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad},
                        opt.stats()["preconditioned"]))
    assert results[0][1] == results[1][1] == 28
    for n, p in results[0][0].items():
        torch.testing.assert_close(results[1][0][n], p, rtol=1e-5, atol=1e-6)
    bf16 = add_lora(small_llama(TINY, tok).to(torch.bfloat16), LORA_8B)
    assert {p.dtype for p in bf16.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in bf16.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_gradient_accumulation_is_a_token_weighted_mean(tok, tmp_path, compose):
    """One step of 2 x 2 accumulated micro-batches equals one step on the 4 blocks at once."""
    exs, _ = _examples(tok, 6)
    blocks = pack(exs, 256, tok.pad_token_id)
    assert len(blocks["input_ids"]) >= 4
    params = []
    for micro, accum in ((4, 1), (2, 2)):
        torch.manual_seed(0)
        model = add_lora(small_llama(TINY, tok), LORA_8B)
        cfg = compose("optim=sgd", "optim.lr=1.0", "optim.momentum=0.0")
        tr = OmegaConf.create({"micro_batch_size": micro, "grad_accumulation": accum, "epochs": 1, "max_steps": 1,
                               "schedule": "constant", "warmup_frac": 0.0, "max_grad_norm": 0.0, "log_every": 1,
                               "checkpoint_every": 0})
        from experiments.common.run import Run

        run = Run(cfg, tmp_path / f"{micro}x{accum}")
        train.train(model, build_optimizer(model, cfg), blocks, tr, 0, run, torch.device("cpu"))
        run.close(False)
        params.append([p.detach().clone() for p in model.parameters() if p.requires_grad])
    for p, q in zip(*params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_tiny_pretrain_then_sft_then_generation_eval_and_report(tmp_path, compose):
    pre_summary = run_job(compose("task=pretrain_arith", "optim=adamw", "optim.lr=3e-3", "debug=default"),
                          tmp_path / "pre")
    base = tmp_path / "pre" / "base"  # debug: the run directory, not outputs/
    assert pre_summary["saved_to"] == str(base) and (base / "model.safetensors").exists() and pre_summary["val_nll"] > 0
    quality = json.loads((base / "base_quality.json").read_text())   # what SFT checks before it starts
    assert quality["accuracy"] == pre_summary["accuracy"] and quality["val_nll"] == pre_summary["val_nll"]
    records = []
    for optim in ("adamw", "dopr_adamw"):
        cfg = compose("task=sft_arith", f"+tuned/sft={optim}", "optim.lr=1e-2", f"task.model.path={base}",
                      "task.model.min_base_accuracy=null",   # a 3-step base: its accuracy is 0
                       f"task.model.tokenizer={base}", "task.data.train_size=16", "task.data.val_size=4",
                       "task.data.max_steps=2", "task.data.max_length=256", "task.train.max_steps=3", "task.train.checkpoint_every=2",
                       "task.eval.generation.problems=6", "task.eval.generation.max_new_tokens=12")
        s = run_job(cfg, tmp_path / optim)
        assert s["steps"] == 3 and 0.0 <= s["accuracy"] <= 1.0 and s["val_nll"] > 0 and s["trainable_params"] > 0
        assert len(s["samples"]) == 3 and (tmp_path / optim / "adapter" / "adapter_model.safetensors").exists()
        assert peft.PeftConfig.from_pretrained(str(tmp_path / optim / "adapter")).r == 8
        rows = [json.loads(line) for line in (tmp_path / optim / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [3] and rows[0]["lr"] == 1e-2  # log_every 5: the last step
        records.append({"summary": json.loads((tmp_path / optim / "summary.json").read_text())})
    weights = hashlib.sha256(b"model.safetensors" + (base / "model.safetensors").read_bytes()).hexdigest()[:16]
    assert [r["summary"]["base"] for r in records] == [{"weights_sha256": weights, "files": 1, "quality": quality}] * 2
    assert pre_summary["base"]["weights_sha256"] == weights   # the pretraining run names the base it wrote
    assert "dopr" in records[1]["summary"] and records[1]["summary"]["dopr"]["preconditioned"] > 0
    from experiments.llm.report import sft

    sft(records, tmp_path / "results", "Made by `test`")
    md = (tmp_path / "results" / "sft_arith.md").read_text()
    assert "dopr_adamw" in md and "exact_match" in md and "Made by" in md
    import csv   # each run, as the table averages it, with its base
    runs = list(csv.DictReader(open(tmp_path / "results" / "sft_arith_runs.csv")))
    assert [(r["optimizer"], float(r["lr"]), r["base"]) for r in runs] == [("adamw", 1e-2, weights), ("dopr_adamw", 1e-2, weights)]
    for r, rec in zip(runs, records):
        assert math.isclose(float(r["val_nll"]), rec["summary"]["val_nll"], rel_tol=1e-6)
        assert float(r["exact_match"]) == rec["summary"]["accuracy"]
    assert (tmp_path / "results" / "sft_arith_nll_vs_accuracy.png").stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["none", "fsdp"])
def test_interrupted_sft_resumes_from_its_checkpoint_to_the_same_result(tmp_path, monkeypatch, compose, sharding):
    cfg = compose("task=sft_arith", "+tuned/sft=dopr_adamw", "optim.lr=1e-2", "debug=default",
                  f"task.sharding={sharding}", "ap.grad_ema=0.9")  # EMA buffers: sharded AP state
    with open_dict(cfg):  # the debug block is merged last: set the run's length there
        cfg.task.debug.train.max_steps = 4
        cfg.task.debug.train.checkpoint_every = 2
        if sharding == "fsdp":  # a one-rank process group; decoding runs on rank 0 alone: not under FSDP
            cfg.task.debug.eval.generation = None
    if sharding == "fsdp":
        def run_job(cfg, out):  # noqa: F811
            return _run_in_process_group(cfg, out, out.parent / f"pg-{out.name}-{len(list(out.parent.iterdir()))}")
    else:
        run_job = globals()["run_job"]
    straight = run_job(copy.deepcopy(cfg), tmp_path / "straight")
    from experiments.common.run import Run

    logged = Run.log

    def preempted_at_step_3(self, metrics, step):  # a SLURM preemption after the step-2 checkpoint
        if step == 3:
            raise KeyboardInterrupt
        logged(self, metrics, step)

    monkeypatch.setattr(Run, "log", preempted_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_job(copy.deepcopy(cfg), tmp_path / "broken")
    monkeypatch.undo()
    resumed = run_job(copy.deepcopy(cfg), tmp_path / "broken")
    assert resumed["val_nll"] == straight["val_nll"] and resumed["train_loss"] == straight["train_loss"]
    assert resumed.get("accuracy") == straight.get("accuracy") and resumed.get("samples") == straight.get("samples")
    steps = [json.loads(line)["step"] for line in (tmp_path / "broken" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_missing_local_base_model_names_the_command_that_makes_it_not_a_hub_download(tmp_path):
    from experiments.llm.sources import MissingResource, locate_all

    local = str(tmp_path / "outputs" / "llm" / "arith_base")
    with pytest.raises(MissingResource) as info:
        locate_all([("model", "base model weights", local, "model", "`python run.py -m sweep=pretrain_arith`", None)],
                   download=False)
    msg = str(info.value)
    assert f"no directory at '{local}'. Make it with `python run.py -m sweep=pretrain_arith`" in msg
    assert "hf download" not in msg and "task.download" not in msg


def test_sft_refuses_a_base_that_pretraining_left_unable_to_do_the_task(tmp_path, compose):
    base = tmp_path / "base"
    base.mkdir()
    (base / "base_quality.json").write_text(json.dumps({"accuracy": 0.0, "val_nll": 0.171, "problems": 128,
                                                         "steps": 1714}))
    t = compose("task=sft_arith", f"task.model.path={base}").task
    with pytest.raises(ValueError, match=r"answers 0.0% of 128 held-out problems \(val NLL 0.171\), below "
                                         r"task.model.min_base_accuracy=0.9"):
        train.check_base_quality(t, {"model": str(base)})
    train.check_base_quality(compose("task=sft_arith", f"task.model.path={base}",
                                     "task.model.min_base_accuracy=null").task, {"model": str(base)})
    (base / "base_quality.json").write_text(json.dumps({"accuracy": 0.969, "val_nll": 0.124, "problems": 128,
                                                         "steps": 1714}))
    train.check_base_quality(t, {"model": str(base)})   # the committed base's 0.969 passes
    (base / "base_quality.json").unlink()
    train.check_base_quality(t, {"model": str(base)})   # a base made elsewhere carries no record: not checked
