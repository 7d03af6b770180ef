"""Registration: the .pth hook is active in every fresh interpreter of the environment, costs no
torch import, patches LLaMA-Factory as it loads (re-exports included) and can be turned off."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def _py(code, **env):
    e = dict(os.environ)
    e.update(env)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()[-1]


def test_hook_active_without_torch():
    out = _py("import sys, llamafactory_liger_fsdp._bootstrap as b; print(b.ACTIVE, 'torch' in sys.modules)")
    assert out == "True False"


def test_hook_imports_nothing_at_start():
    """The .pth line runs in every Python process of the environment (pip, linters, DataLoader workers): at start it
    adds only the plugin's package, the hook and the hooked names -- no importlib.abc/resources, pathlib, re, torch.
    (-X importtime lists each module imported after start-up began, indented under the import that caused it.)"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", "pass"], capture_output=True, text=True, env=env,
                          timeout=120)
    tree = [line.split("|")[2] for line in proc.stderr.splitlines() if line.count("|") == 2 and "import time:" in line]
    hook = next(i for i, name in enumerate(tree) if name.strip() == "llamafactory_liger_fsdp._bootstrap")
    depth = len(tree[hook]) - len(tree[hook].lstrip())
    under = []  # the modules imported inside the hook's import, listed before it at a deeper indent
    for name in reversed(tree[:hook]):
        if len(name) - len(name.lstrip()) <= depth:
            break
        under.append(name.strip())
    assert set(under) <= {"llamafactory_liger_fsdp", "llamafactory_liger_fsdp._import_hook",
                          "llamafactory_liger_fsdp.hooked"}, under


def test_v1_engine_refusals_before_any_rank(tmp_path):
    """USE_V1=1: what the yaml alone decides is refused in the launching process, once, last, with the fix -- here a
    CP yaml that would stop every rank (cp_size without flash_attention_2; every such yaml, in process:
    test_refusal_paths.py::test_cp_yamls_that_stop_every_rank_refused_before_any_rank)."""
    import yaml

    from llamafactory_liger_fsdp.integration.v1 import cp_args

    cfg = tmp_path / "v1.yaml"
    cfg.write_text(yaml.safe_dump({"model": "whatever", "kernel_config": {"name": "liger_fsdp"},
                                   "micro_batch_size": 2, **cp_args.as_yaml(2)}))
    expected = "cp_size: 2` with `flash_attn: sdpa`"
    cli = os.path.join(os.path.dirname(sys.executable), "llamafactory-cli")
    proc = subprocess.run([cli, "sft", str(cfg)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, USE_V1="1", FORCE_TORCHRUN="1", NPROC_PER_NODE="2"))
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    last = out.strip().splitlines()[-1]
    assert last.startswith("[liger_fsdp] error: ") and expected in last and "Fix:" in last, out[-3000:]
    assert out.count("[liger_fsdp] error") == 1 and "Initializing 2 distributed tasks" not in out


@pytest.mark.parametrize("where", ["a patcher", "the integration's import"])
def test_a_failing_hook_leaves_llamafactory_importable(where):
    """Any exception while hooking a module (not only the PatchError of a moved patch point) leaves LLaMA-Factory as
    installed: `import llamafactory` and its parser work, and one line says the plugin is unavailable and why."""
    force = ("import llamafactory_liger_fsdp.integration.llamafactory as m\n"
             "def boom(module):\n    raise RuntimeError('forced in the test')\n"
             "m.patch_parser = m.patch_loader = boom\n" if where == "a patcher" else
             "import sys\nsys.modules['llamafactory_liger_fsdp.integration'] = None\n")
    code = force + ("import llamafactory, llamafactory.hparams.parser as p, llamafactory.model.loader as l\n"
                    "print('imported', hasattr(p, 'get_train_args'), getattr(p._parse_args, '__liger_fsdp_patch__', "
                    "False))")
    e = dict(os.environ)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "imported True False", proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "[liger_fsdp]" in line]
    assert len(said) == 1 and said[0].startswith("[liger_fsdp] unavailable: cannot hook llamafactory.") and (
        ("forced in the test" if where == "a patcher" else "ModuleNotFoundError") in said[0]), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_loader_and_reexports_patched_and_unpatch_restores():
    """One fresh interpreter: every patched name (re-exports included) carries the patch, then unpatch() restores them."""
    code = (
        "import llamafactory.model as m, llamafactory.model.loader as l, llamafactory.train.sft.workflow as w, "
        "llamafactory.hparams.parser as p, llamafactory.launcher as la\n"
        "from llamafactory_liger_fsdp import integration\n"
        "ok = all(getattr(f, '__liger_fsdp_patch__', False) for f in (m.load_model, l.load_model, w.load_model, "
        "p._parse_args, la.launch))\n"
        "same = m.load_model is w.load_model is l.load_model\n"
        "integration.unpatch()\n"
        "print(ok, same, getattr(l.load_model, '__liger_fsdp_patch__', False), "
        "getattr(m.load_model, '__liger_fsdp_patch__', False))"
    )
    assert _py(code) == "True True False False"


def test_disable_env_keeps_keys_accepted():
    """The off switch: the hook stays (yamls naming liger_fsdp still parse), the plugin is off."""
    code = (
        "import llamafactory_liger_fsdp._bootstrap as b\n"
        "from llamafactory_liger_fsdp.integration.llamafactory import config_from_args\n"
        "rest, cfg = config_from_args({'stage': 'sft', 'liger_fsdp': True})\n"
        "print(b.ACTIVE, cfg.enabled, sorted(rest))"
    )
    assert _py(code, LLAMAFACTORY_LIGER_FSDP_DISABLE="1") == "True False ['stage']"


PTH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "llamafactory_liger_fsdp.pth")


@pytest.mark.parametrize("package", [None, "import no_such_module_anywhere\n"])
def test_pth_line_without_the_package(tmp_path, package):
    """The .pth line in a site directory where the package is missing (pip mid-way through reinstalling it, a package
    removed by hand) says nothing; a package that is there but fails to import is still reported by site."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "llamafactory_liger_fsdp.pth").write_text(open(PTH).read())
    if package is not None:  # the package, broken inside: _bootstrap imports a module that does not exist
        (site_dir / "llamafactory_liger_fsdp").mkdir()
        (site_dir / "llamafactory_liger_fsdp" / "__init__.py").write_text("")
        (site_dir / "llamafactory_liger_fsdp" / "_bootstrap.py").write_text(package)
    code = f"import site, sys; site.addsitedir({str(site_dir)!r}); print('llamafactory_liger_fsdp' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=60)  # -S: no site-packages, so the installed plugin is out of reach
    assert proc.returncode == 0, proc.stderr
    if package is None:
        assert (proc.stdout.strip(), proc.stderr) == ("False", "")
    else:
        assert "no_such_module_anywhere" in proc.stderr and "Error processing line 1" in proc.stderr


def test_pth_installed():
    import site

    dirs = site.getsitepackages() + [site.getusersitepackages()]
    assert any(os.path.exists(os.path.join(d, "llamafactory_liger_fsdp.pth")) for d in dirs)
