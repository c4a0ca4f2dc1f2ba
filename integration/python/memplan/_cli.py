"""The `memplan` command a wheel installs: runs the CLI binary shipped inside the package
(memplan/bin/memplan, built from the same sources as the extension) with the same arguments,
so `pip install .` gives the command line as well as the library."""

import os
import sys


def main():
    binary = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "memplan")
    if not os.access(binary, os.X_OK):
        sys.stderr.write("memplan: error: the memplan command is not in this installation (%s); "
                         "reinstall with `pip install .` from the memplan sources\n" % binary)
        return 2
    os.execv(binary, [binary] + sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
