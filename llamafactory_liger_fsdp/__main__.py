"""``python -m llamafactory_liger_fsdp doctor [sft.yaml]``."""

import sys

from .doctor import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "doctor":
        print("usage: python -m llamafactory_liger_fsdp doctor [sft.yaml]")
        sys.exit(2)
    sys.exit(main(args))
