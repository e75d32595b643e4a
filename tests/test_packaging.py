"""A non-editable install carries what moequant reads at run time: the wheel built from this tree holds the
bundled recipes, calibration specs, model configs and zoo models, and moequant imported from the unpacked
wheel alone (not this checkout) finds a bundled recipe by name and its calibration spec."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_holds_the_package_data_and_works_from_outside_the_checkout(tmp_path):
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("moequant-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("recipes", "calibration"):
        expected = {f"moequant/{shipped}/{p.name}" for p in (ROOT / "moequant" / shipped).glob("*.yaml")}
        assert expected and expected <= names, sorted(expected - names)
    assert {"moequant/zoo/tiny-qwen2moe/model.safetensors", "moequant/zoo/tiny-qwen2moe/config.json"} <= names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import moequant, moequant.measure.data as d; from moequant.plan.recipe import load_recipe; "
        "r = load_recipe('selective'); print(moequant.__file__); print(r.model); "
        "print(len(d.load_documents('mix')) > 0); print(d.SPEC_DIR.is_dir())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    where, model, found, specs = done.stdout.split()
    assert where.startswith(str(site)) and model and found == "True" and specs == "True"


def test_a_bundled_recipe_by_name_and_a_missing_one_named():
    from moequant.errors import UserError
    from moequant.plan.recipe import bundled_recipe, load_recipe

    assert bundled_recipe("selective") == ROOT / "moequant" / "recipes" / "selective.yaml"
    assert bundled_recipe("uniform-int4.yaml") == ROOT / "moequant" / "recipes" / "uniform-int4.yaml"
    assert load_recipe("selective").model == load_recipe(ROOT / "recipes" / "selective.yaml").model
    with pytest.raises(UserError, match="bundled recipes, by name: .*selective"):
        load_recipe("no-such-recipe")
