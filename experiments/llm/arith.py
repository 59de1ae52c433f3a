"""The CPU-scale analogue of math SFT: procedurally generated arithmetic word problems.

A problem starts from a quantity and applies `steps` additions and subtractions; the solution
works each one column by column, carries and borrows written out, and ends in "The answer is
\\boxed{answer}.":

    Problem:  Mia has 347 stamps. She gets 58 more. Then she gives away 19. How many stamps does Mia have now?
    Solution: 347+58: 7+8=15, 4+5+1=10, 3+0+1=4, so 405.
              405-19: 15-9=6, 10-1-1=8, 4-0-1=3, so 386.
              The answer is \\boxed{386}.

Every character of a solution follows from the ones before it, so next-token training is the whole
job, but at deployment the model reads its own earlier results: a wrong digit in the first line
makes every later line and the answer wrong (test-time feedback). Records use OpenMathInstruct-2's
field names (`problem`, `generated_solution`, plus `expected_answer`) so the same pipeline reads both.

The tokenizer is character level, built here (no download) as a Hugging Face fast tokenizer with a
chat template, so the SFT pipeline treats it exactly as it treats Llama's.
"""
from __future__ import annotations

import random
import string

NAMES = (("Mia", "She"), ("Leo", "He"), ("Ava", "She"), ("Noah", "He"), ("Zoe", "She"), ("Omar", "He"),
         ("Ivy", "She"), ("Ben", "He"), ("Lena", "She"), ("Sam", "He"), ("Ruth", "She"), ("Kai", "He"))
OBJECTS = ("stamps", "marbles", "coins", "apples", "cards", "shells", "books", "beads")
GAIN = ("{p} gets {b} more.", "{p} finds {b} more.", "{p} buys {b} more.")
LOSS = ("{p} gives away {b}.", "{p} loses {b}.", "{p} sells {b}.")
SPECIAL_TOKENS = ("<pad>", "<bos>", "<unk>", "<|end|>", "<|user|>", "<|assistant|>")
ALPHABET = string.ascii_letters + string.digits + " .,:;?!'+-=*()\\{}\n"
# Llama-3-like: BOS, then <|role|>content<|end|> per message; the assistant turn's <|end|> is EOS.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _digits(n: int, width: int) -> list:
    """Least significant first, zero-padded to `width`."""
    return [int(c) for c in str(n).zfill(width)[::-1]]


def column_addition(a: int, b: int) -> tuple:
    """('347+58: 7+8=15, 4+5+1=10, 3+0+1=4, so 405.', 405)."""
    width = len(str(max(a, b)))
    cols, carry = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        s = x + y + carry
        cols.append(f"{x}+{y}{'+1' if carry else ''}={s}")
        carry = s // 10
    return f"{a}+{b}: {', '.join(cols)}, so {a + b}.", a + b


def column_subtraction(a: int, b: int) -> tuple:
    """('405-19: 15-9=6, 10-1-1=8, 4-0-1=3, so 386.', 386); a >= b. A borrowing column writes its
    top digit plus ten and the next column subtracts the borrowed 1."""
    if b > a:
        raise ValueError(f"column_subtraction needs a >= b, got {a} - {b}")
    width = len(str(a))
    cols, borrow = [], 0
    for x, y in zip(_digits(a, width), _digits(b, width)):
        top = x + 10 if x - borrow < y else x
        cols.append(f"{top}-{y}{'-1' if borrow else ''}={top - y - borrow}")
        borrow = int(top > x)
    return f"{a}-{b}: {', '.join(cols)}, so {a - b}.", a - b


def word_problem(rng: random.Random, steps: int, max_value: int, max_operand: int) -> dict:
    """One problem with `steps` operations; every intermediate quantity stays in [0, max_value]."""
    (name, pronoun), obj = rng.choice(NAMES), rng.choice(OBJECTS)
    value = rng.randint(max_operand, max_value - max_operand)
    sentences = [f"{name} has {value} {obj}."]
    lines = []
    for i in range(steps):
        gain = rng.random() < 0.5
        if value + 2 > max_value:
            gain = False
        elif value < 2:
            gain = True
        b = rng.randint(2, min(max_operand, max_value - value if gain else value))
        line, value = column_addition(value, b) if gain else column_subtraction(value, b)
        sentence = rng.choice(GAIN if gain else LOSS).format(p=pronoun if i == 0 else pronoun.lower(), b=b)
        sentences.append(f"Then {sentence}" if i else sentence)
        lines.append(line)
    sentences.append(f"How many {obj} does {name} have now?")
    solution = "\n".join(lines) + f"\nThe answer is \\boxed{{{value}}}."
    return {"problem": " ".join(sentences), "generated_solution": solution, "expected_answer": str(value)}


def word_problems(n: int, seed: int, min_steps: int, max_steps: int, max_value: int, max_operand: int) -> list:
    rng = random.Random(seed)
    return [word_problem(rng, rng.randint(min_steps, max_steps), max_value, max_operand) for _ in range(n)]


def pretraining_document(p: dict) -> str:
    """A problem as plain text, without the chat template (what SFT then teaches, with longer chains).
    It ends in the solution's own answer sentence, so the base has produced "\\boxed{N}": with tied
    embeddings and LoRA on the blocks only, SFT could not teach a character the base never produced
    (measured: up to lr 3e-3 the SFT'd model wrote "\\boxed*142D"), nor, in one short epoch, a bare
    "\\boxed{N}" line in place of the answer sentence it knew (it copied the wrong number)."""
    return f"Q: {p['problem']}\nA: {p['generated_solution']}"


def char_tokenizer():
    """A character-level `PreTrainedTokenizerFast` with the chat template above (EOS = <|end|>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + tuple(ALPHABET))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<|end|>",
                                  pad_token="<pad>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok
