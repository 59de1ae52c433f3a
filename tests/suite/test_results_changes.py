"""experiments/common/results_changes.py: the last line of `make demo`, what a regenerated results/ changed against
HEAD: rounding (every number within its last printed digit), the stamp alone, or a move."""
import subprocess

from experiments.common import results_changes

CSV = "optimizer,lr,dist\ndopr_muon,1.0,0.2551898\nmuon,0.01,0.3183369\n"
MD = ("Runs made by `python run.py -m sweep=x` (1 run). Tables by `python -m experiments.report x` at commit "
      "`0f50919`.\n\n| dopr_muon | 1 | 0.2552 |\n")


def _repo(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "t.csv").write_text(CSV)
    (tmp_path / "results" / "t.md").write_text(MD)
    (tmp_path / "results" / "f.png").write_bytes(b"\x89PNG one")
    git("init", "-q"), git("add", "."), git("commit", "-qm", "results")
    return tmp_path


def test_an_unchanged_regeneration_says_so_and_counts_what_it_rewrote(tmp_path):
    root = _repo(tmp_path)
    (root / "results" / "t.csv").write_text(CSV)   # rewritten, same bytes
    line = results_changes.summarize(root, "results", since=0)
    assert line == "results/ 3 files rewritten: all as committed (git diff empty)"


def test_last_digit_noise_is_rounding_a_new_stamp_is_said_a_moved_number_is_not(tmp_path):
    root = _repo(tmp_path)
    (root / "results" / "t.csv").write_text(CSV.replace("0.3183369", "0.318337"))     # one digit, last place
    (root / "results" / "t.md").write_text(MD.replace("0f50919", "864be0f").replace("1 run", "2 runs"))
    line = results_changes.summarize(root, "results")
    assert line == ("results/: nothing moved beyond rounding; 1 changed at rounding level only (results/t.csv); "
                    "1 changed in their stamp only (results/t.md)")
    (root / "results" / "t.csv").write_text(CSV.replace("0.2551898", "0.2202031"))
    (root / "results" / "t.md").write_text(MD.replace("0.2552", "0.2202"))
    (root / "results" / "f.png").write_bytes(b"\x89PNG two")
    (root / "results" / "new.md").write_text("x\n")
    line = results_changes.summarize(root, "results")
    assert line == ("results/: moved beyond rounding: results/t.csv (dopr_muon dist: 0.2551898 -> 0.2202031), "
                    "results/t.md (line 3: 0.2552 -> 0.2202); figures redrawn: results/f.png; new: results/new.md")
    assert "\n" not in line


def test_changed_words_are_a_move_and_a_table_digits_rounding_is_not():
    assert results_changes.largest_move("| adamw | 1 |", "| muon | 1 |") == "text changed: '| adamw |' -> '| muon |'"
    assert results_changes.largest_move("9950798.47347483", "9950798.0") is None   # written at 7 digits
    assert results_changes.largest_move("1.0", "1.5") == "line 1: 1.0 -> 1.5"
    assert results_changes.largest_move("2.627e+04", "2.628e+04") is None      # one unit in the last digit
    assert results_changes.largest_move("2.627e+04", "2.629e+04") == "line 1: 2.627e+04 -> 2.629e+04"


def test_the_largest_relative_move_is_named_by_its_row_and_column_not_the_first_difference():
    # issue 72 item 3: the demo's last line printed 10.86132 -> 10.86158 (the first differing token) while a
    # DoPr-Muon median moved 17%
    md = ("| arm | lr | val_loss_min | val_loss_median |\n|---|---|---|---|\n| adamw | 0.03 | 10.86 | 28.52 |\n"
          "| dopr_muon | 1.0 | 2.029e+04 | 5.049e+04 |\n| dopr_muon | 0.01 | 1.1e+04 | 2.627e+04 |\n")
    moved = md.replace("10.86", "10.87").replace("5.049e+04", "5.907e+04")
    assert results_changes.largest_move(md, moved) == "dopr_muon 1.0 val_loss_median: 5.049e+04 -> 5.907e+04"
    csv = "arm,setting,val_loss_min,val_loss_median\nadamw,\"a=1, lr=0.03\",10.86132,28.52267\nmuon,\"a=1, lr=0.01\",39.37,1040\n"
    moved = csv.replace("10.86132", "10.86158").replace("1040", "1219")
    assert results_changes.largest_move(csv, moved, is_csv=True) == "muon val_loss_median: 1040 -> 1219"
    assert results_changes.largest_move(csv, csv.replace("10.86132", "10.86158"), is_csv=True) == \
        "adamw val_loss_min: 10.86132 -> 10.86158"
