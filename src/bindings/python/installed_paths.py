# The executables installed with the package, in netdam/bin/ beside this file
# (src/bindings/CMakeLists.txt installs it as _paths.py). A build tree's
# netdam package has a generated _paths.py naming the build's executables
# instead.
import os

_BIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")
NETDAMD = os.path.join(_BIN, "netdamd")
NETDAM_MMU = os.path.join(_BIN, "netdam-mmu")
NETDAM_CLI = os.path.join(_BIN, "netdam")
