"""The tree speaks of its code, commits and result files, not of the work periods that made them: no ordinal or
numbered work period in any tracked file (figures are dated by date, commit and result file)."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|" \
          r"fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|\d+(?:st|nd|rd|th))"
DIARY = re.compile(rf"\b{ORDINAL}[- ]session|\b(?:this|that|last|previous|earlier|next|the same) session\b|"
                   r"\bsessions? \d+\b|\bsession's (?:start|end|last|note)", re.I)


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, timeout=60)
    except OSError:
        out = None
    if out is None or out.returncode != 0:  # not a git checkout (an sdist): every file under the root
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    return [ROOT / line for line in out.stdout.splitlines()]


def test_no_diary_words_in_the_tree():
    found = []
    for path in tracked_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary
        for n, line in enumerate(text.splitlines(), 1):
            if DIARY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found[:40])


def test_the_pattern_sees_the_words_and_not_the_process_sessions():
    s = " sess" + "ion"  # spelled apart, so this file does not hold what it looks for
    assert DIARY.search("measured in the tenth" + s) and DIARY.search("this" + s + "'s run")
    assert DIARY.search("before" + s + " 5") and DIARY.search("(12th" + s + ")")
    assert not DIARY.search("start_new_session=True") and not DIARY.search('scope="session"')
    assert not DIARY.search("its own process session, so killpg stops it")
