"""Language models (section "Language Models", appendix "Supervised Fine-Tuning"): LoRA SFT of Llama
on OpenMathInstruct-2 with lm-eval (task=sft_llama32_3b, sft_llama31_8b), and its CPU-scale analogue
on generated arithmetic word problems (task=pretrain_arith, then task=sft_arith).

    arith.py     the generated word problems and the character tokenizer
    data.py      chat formatting, completion-only labels, packing, OpenMathInstruct-2
    sources.py   weights and data from local paths or the HF cache, with one clear error
    model.py     HF / small Llama, LoRA, gradient checkpointing
    train.py     the SFT task entry and the training loop (also used by pretrain.py)
    pretrain.py  the CPU analogue's base model
    evaluate.py  validation NLL, greedy exact match, lm-evaluation-harness
    report.py    the sweep's table and NLL-vs-accuracy figure
    ranks.py     stable, nuclear and activation stable ranks (appendix "Stable Ranks")
    stable_ranks.py  the stable-rank figures over finished SFT runs
"""
