"""Running an example leaves the clone clean: by default its outputs go under runs/ (git-ignored); only
--update-docs writes the published files in docs/img, and only with the published settings. Only the path
resolution is exercised (each example's parse_args): nothing is trained."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS_IMG = ROOT / "docs" / "img"

# example -> (the attribute holding its main output, that file's name, an option away from the published run)
EXAMPLES = {
    "mnist": ("out", "mnist_seed0.json", ["--steps", "50"]),
    "wan_time_to_loss": ("out", "wan_time_to_loss.json", ["--steps", "10"]),
    "mnist1d": ("out", "mnist1d.json", ["--lr", "0.1"]),
    "shakespeare_gpt": ("out", "shakespeare_gpt.json", ["--nodes", "2"]),
    "hf_shakespeare": ("out", "hf_shakespeare.json", ["--H", "5"]),
    "elastic_compute": ("plot", "elastic_compute.png", ["--quick"]),
    "async_heterogeneous": ("out", "async_heterogeneous.json", ["--rounds", "3"]),
    "async_toy_study": ("out", "async_toy_study.json", ["--seeds", "0"]),
    "ui_screenshots": ("out", "ui_runs.png", ["--rounds", "3"]),
}


def _example(name):
    if str(ROOT / "examples") not in sys.path:  # examples import their folder's helpers, as scripts do
        sys.path.insert(0, str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location(f"example_output_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # runs/ is relative to the working directory: keep the checkout out of it


def test_every_example_that_can_write_into_docs_is_covered():
    # Every example that imports the output helper is in EXAMPLES; none writes into docs/ by another route.
    users = {p.stem for p in (ROOT / "examples").glob("*.py") if "published_output" in p.read_text()}
    assert users - {"published_output"} == set(EXAMPLES)
    for path in [*(ROOT / "examples").glob("*.py"), *(ROOT / "run").glob("*.py")]:
        if path.stem != "published_output":  # no other script builds a path into docs/ itself
            assert not re.search(r"""["']docs[/"']|DOCS_IMG""", path.read_text()), path


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_by_default_an_example_writes_under_runs(name):
    attr, file, _ = EXAMPLES[name]
    path = getattr(_example(name).parse_args([]), attr)
    assert path == Path("runs") / file
    assert not path.is_absolute()  # under the working directory's runs/, which .gitignore lists
    assert not Path("runs").exists()  # resolving a path creates nothing


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_update_docs_resolves_to_the_published_file_in_docs_img(name):
    attr, file, _ = EXAMPLES[name]
    assert getattr(_example(name).parse_args(["--update-docs"]), attr) == DOCS_IMG / file


def test_mnist_update_docs_keeps_one_published_file_per_seed_and_for_the_original_setup():
    mnist = _example("mnist")
    assert mnist.parse_args(["--seed", "2", "--update-docs"]).out == DOCS_IMG / "mnist_seed2.json"
    assert mnist.parse_args(["--published", "--update-docs"]).out == DOCS_IMG / "mnist_published.json"
    assert mnist.parse_args(["--seed", "2"]).out == Path("runs/mnist_seed2.json")
    assert mnist.parse_args(["--published"]).out == Path("runs/mnist_published.json")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_explicit_out_is_kept(name, tmp_path):
    attr, file, _ = EXAMPLES[name]
    flag = f"--{attr}"
    given = str(tmp_path / "elsewhere" / file)
    assert getattr(_example(name).parse_args([flag, given]), attr) == Path(given)
    # and with any other setting too: --out / --plot always wins over the default
    assert getattr(_example(name).parse_args([*EXAMPLES[name][2], flag, given]), attr) == Path(given)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_update_docs_with_other_settings_is_refused_before_training(name, capsys):
    attr, file, changed = EXAMPLES[name]
    example = _example(name)
    assert getattr(example.parse_args(changed), attr).parts[0] == "runs"  # the setting itself is fine
    with pytest.raises(SystemExit) as refused:
        example.parse_args([*changed, "--update-docs"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "--update-docs" in err and "published" in err and changed[0] in err, err
    with pytest.raises(SystemExit):  # --update-docs picks the path itself
        example.parse_args([f"--{attr}", "x", "--update-docs"])


@pytest.mark.spawns
def test_the_refusal_comes_from_the_command_line_before_any_data_is_loaded(tmp_path):
    # The real script, as a newcomer runs it: exit status 2, a clear message, nothing written anywhere.
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "mnist.py"), "--steps", "5", "--update-docs"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--steps 5 (published: 300)" in done.stderr
    assert "MNIST:" not in done.stdout
    assert not any(tmp_path.iterdir())
