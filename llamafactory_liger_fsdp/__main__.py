"""``python -m llamafactory_liger_fsdp doctor [sft.yaml]``, ``... train sft.yaml`` and ``... env``.

``train`` is ``llamafactory-cli train`` with the plugin active in the launcher and in every worker
(``FORCE_TORCHRUN``/torchrun included), also where the ``.pth`` hook does not run. ``env`` prints the versions,
device, kernel backend and import hook for a bug report (:mod:`.env_report`). ``fingerprints [--record]`` checks (records)
this stack's upstream code against what CI saw (:mod:`.fingerprints`)."""

import os
import sys

USAGE = "usage: python -m llamafactory_liger_fsdp doctor [sft.yaml [key=value ...]]\n" \
        "       python -m llamafactory_liger_fsdp train sft.yaml [key=value ...]\n" \
        "       python -m llamafactory_liger_fsdp env\n" \
        "       python -m llamafactory_liger_fsdp fingerprints [--record [LABEL]]"


def train(args: list[str]) -> int:
    from . import _bootstrap

    _bootstrap.install()
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    activate = os.path.join(package_root, "llamafactory_liger_fsdp", "_activate")
    paths = [activate, package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    sys.argv = ["llamafactory-cli", "train", *args]
    from llamafactory.cli import main

    main()
    return 0


if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["doctor"]:
        from .doctor import main as doctor

        sys.exit(doctor(argv))
    if argv == ["env"]:
        from .env_report import main as env

        sys.exit(env())
    if argv[:1] == ["fingerprints"]:
        from .fingerprints import main as fingerprints

        sys.exit(fingerprints(argv[1:]))
    if argv[:1] == ["train"] and len(argv) > 1:
        sys.exit(train(argv[1:]))
    print(USAGE)
    sys.exit(2)
