"""Builds the netdam Python package with CMake (pyproject.toml, docs/INSTALL.md).

    pip install --no-build-isolation .

(--no-build-isolation: the build needs only setuptools and wheel, which
Debian's python3-setuptools and python3-wheel provide; without it pip would
fetch them from PyPI.)

The package is what `cmake --install --component python` lays out
(src/bindings/CMakeLists.txt): python/netdam/*.py, the compiled modules
(netdam._netdam, and netdam._torch_backend when torch is found), and the
daemons the package starts, netdamd, netdam-mmu and netdam, in netdam/bin/.
setup.py configures a CMake build of its own, builds only what the package
needs, and installs that component into the wheel's tree.

Environment:
  NETDAM_CMAKE_BUILD_DIR  an existing CMake build directory to build in and
                          install from instead of a new one (configured
                          with NETDAM_PYTHON=ON for the same interpreter):
                          saves a full build when one is at hand, as in
                          CI's tests/install/pip_install_test.sh.
  NETDAM_CMAKE_ARGS       more arguments for configuring a new build, e.g.
                          -DNETDAM_TORCH=OFF (the default builds the torch
                          backend when this interpreter can import torch).
"""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE_DIR = os.path.dirname(os.path.abspath(__file__))


def project_version():
    """The version in CMakeLists.txt's project(), the one source of it."""
    with open(os.path.join(SOURCE_DIR, "CMakeLists.txt")) as f:
        m = re.search(r"project\(netdam\s+VERSION\s+([0-9.]+)", f.read())
    if not m:
        raise RuntimeError("no project(netdam VERSION ...) in CMakeLists.txt")
    return m.group(1)


class CMakeBuild(build_ext):
    """Replaces compiling the placeholder extension with the CMake build."""

    def run(self):
        if self.inplace:
            raise RuntimeError("netdam: no in-place builds; use PYTHONPATH=<build>/python "
                               "with a CMake build (README.md)")
        build_dir = os.environ.get("NETDAM_CMAKE_BUILD_DIR")
        if build_dir:
            build_dir = os.path.abspath(build_dir)
            if not os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
                raise RuntimeError(f"NETDAM_CMAKE_BUILD_DIR={build_dir} is not a configured CMake build")
        else:
            build_dir = os.path.join(os.path.abspath(self.build_temp), "cmake")
            self.configure(build_dir)
        self.spawn(["cmake", "--build", build_dir, "--target", "netdam_python_package"])
        # --strip: the wheel need not carry the debug information of a
        # RelWithDebInfo build (hundreds of MB with torch).
        self.spawn(["cmake", "--install", build_dir, "--component", "python", "--strip",
                    "--prefix", os.path.abspath(self.build_lib)])

    def configure(self, build_dir):
        torch = "ON" if importlib.util.find_spec("torch") else "OFF"
        args = ["cmake", "-S", SOURCE_DIR, "-B", build_dir,
                "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                f"-DPython3_EXECUTABLE={sys.executable}",
                "-DNETDAM_PYTHON=ON", f"-DNETDAM_TORCH={torch}", "-DNETDAM_BENCH=OFF"]
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]
        args += shlex.split(os.environ.get("NETDAM_CMAKE_ARGS", ""))
        self.spawn(args)

    # The placeholder has no sources; the files come from the install above.
    def get_outputs(self):
        return []


setup(
    version=project_version(),
    packages=["netdam"],
    license_files=["LICENSE"],
    package_dir={"netdam": "python/netdam"},
    # A placeholder: it makes the wheel platform-specific and runs
    # CMakeBuild, which builds the real modules.
    ext_modules=[Extension("netdam._netdam", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # Not into build/, the README's CMake build directory; beside the build
    # that is reused, if one is.
    options={"build": {"build_base": os.path.join(os.environ.get("NETDAM_CMAKE_BUILD_DIR", ""),
                                                  "build-python")}},
    zip_safe=False,
)
