"""The GPU image's pins, read from the Dockerfile: every package it installs has an exact version (or, for apex,
which is not on PyPI, a commit), each version lies inside setup.py's ranges for the image's Python, the packages
the GPU stack needs are all there, and megappo itself comes from the copied source.

`docker build` cannot run here (no Docker engine, and the build compiles CUDA extensions): this test checks what
can be checked without building. The pinned set minus the compiled packages was resolved once with
`pip install --dry-run --only-binary=:all: --python-version 3.12 --platform manylinux_2_XX_x86_64 ...` (see the
Dockerfile); the image's own last step checks at build time that every pin held."""
from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
# what the issue asks the image to carry, by distribution name
STACK = ("torch", "megatron-core", "transformer-engine", "apex", "sglang", "sglang-router")
# options of `pip install` that take a value (the value is not a requirement)
VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "--config-settings", "-C", "--index-url", "-i",
                 "--extra-index-url", "--target", "-t"}


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        if line.lstrip().startswith("#"):  # a comment between continuation lines
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def _args() -> dict[str, str]:
    args = {}
    for word, rest in _instructions():
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip().strip('"')
    return args


def _expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def _runs() -> list[str]:
    args = _args()
    return [_expand(rest, args) for word, rest in _instructions() if word == "RUN"]


def _pip_installs() -> list[list[str]]:
    """The arguments of every `pip install` in a RUN (shell words, environment assignments dropped)."""
    installs = []
    for run in _runs():
        lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands: list[list[str]] = [[]]
        for token in lexer:
            if token in ("&&", "||", ";", "|"):
                commands.append([])
            else:
                commands[-1].append(token)
        for words in commands:
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # VAR=value before the command
            if words[:2] == ["pip", "install"]:
                installs.append(words[2:])
    return installs


def _requirements(args: list[str]) -> list[str]:
    out, skip = [], False
    for word in args:
        if skip:
            skip = False
        elif word in VALUE_OPTIONS:
            skip = True
        elif not word.startswith("-"):
            out.append(word)
    return out


def _constraints() -> dict[str, Version]:
    """The pins written into /opt/constraints.txt, by canonical name."""
    run = next(r for r in _runs() if "/opt/constraints.txt" in r and "printf" in r)
    pins = {}
    for word in shlex.split(run.split(">")[0]):
        if "==" in word:
            req = Requirement(word)
            pins[canonicalize_name(req.name)] = Version(str(req.specifier).removeprefix("=="))
    return pins


def _setup_lists() -> tuple[list[str], dict[str, list[str]], str]:
    """INSTALL_REQUIRES, EXTRAS and python_requires from setup.py, read without running it."""
    tree = ast.parse((REPO / "setup.py").read_text())
    values = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and t.id in ("INSTALL_REQUIRES", "EXTRAS")}
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    python_requires = next(ast.literal_eval(k.value) for k in call.keywords if k.arg == "python_requires")
    return values["INSTALL_REQUIRES"], values["EXTRAS"], python_requires


def _image_environment() -> dict[str, str]:
    """Marker environment of the image's Python (its version from the Dockerfile, Linux x86-64)."""
    version = _args()["PYTHON_VERSION"]
    env = default_environment()
    env.update(python_version=version, python_full_version=f"{version}.0", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", os_name="posix", implementation_name="cpython",
               platform_python_implementation="CPython")
    return env


def _local_install() -> tuple[list[str], list[str]]:
    """(the pip arguments, the extras) of the install of megappo from the copied source."""
    for args in _pip_installs():
        for req in _requirements(args):
            m = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", req)
            if m:
                return args, (m.group(1) or "").split(",") if m.group(1) else []
    raise AssertionError("the Dockerfile does not `pip install .` (megappo from the copied source)")


def test_the_image_python_is_one_setup_py_admits():
    _, _, python_requires = _setup_lists()
    assert Version(_args()["PYTHON_VERSION"]) in SpecifierSet(python_requires)


def test_every_install_is_pinned_and_constrained():
    installs = _pip_installs()
    assert installs, "no `pip install` found in the Dockerfile"
    unpinned = []
    for args in installs:
        assert "-c" in args and args[args.index("-c") + 1] == "/opt/constraints.txt", \
            f"`pip install {' '.join(args)}` does not take /opt/constraints.txt"
        for word in _requirements(args):
            if re.fullmatch(r"\.(\[[\w,-]+\])?", word):
                continue  # megappo, from the copied source (checked below)
            req = Requirement(word)
            if req.url:
                ok = re.search(r"@[0-9a-f]{40}$", req.url) is not None  # a commit: tags can move
            else:
                ok = len(req.specifier) == 1 and next(iter(req.specifier)).operator == "=="
            if not ok:
                unpinned.append(word)
    assert not unpinned, f"not pinned to one version (or one commit): {unpinned}"


def test_the_stack_the_issue_asks_for_is_pinned():
    pins = _constraints()
    direct = {}
    for args in _pip_installs():
        for word in _requirements(args):
            if not word.startswith("."):
                req = Requirement(word)
                direct[canonicalize_name(req.name)] = req
    missing = [name for name in STACK if name not in pins and name not in direct]
    assert not missing, f"not in the image: {missing}"
    # an install's own pin and the constraint agree
    for name, req in direct.items():
        if name in pins and not req.url:
            assert pins[name] in req.specifier, f"{name}: installed as {req}, constrained to =={pins[name]}"


def test_every_pin_lies_inside_setup_py_ranges():
    """Each requirement of megappo (and of the extras the image installs, plus transformer-engine from `gpu`) that
    applies to the image's Python has a pin, and the pin satisfies it."""
    install_requires, extras, _ = _setup_lists()
    _, installed_extras = _local_install()
    assert set(installed_extras) <= set(extras), f"unknown extras {installed_extras}"
    env = _image_environment()
    pins = _constraints()
    requirements = [*install_requires, *(r for e in installed_extras for r in extras[e])]
    # from the `gpu` extra the image carries transformer-engine; flash-attn is left out (megatron-core's attention
    # is transformer-engine's), so that extra is not installed whole
    requirements += [r for r in extras["gpu"] if canonicalize_name(Requirement(r).name) == "transformer-engine"]
    outside = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"setup.py requires {text} but the image does not pin {req.name}"
        if not req.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{req.name}=={pins[name]} is outside setup.py's {text!r}")
    assert not outside, outside


def test_the_sglang_extra_brings_the_router():
    _, extras, _ = _setup_lists()
    names = {canonicalize_name(Requirement(r).name) for r in extras["sglang"]}
    assert {"sglang", "sglang-router"} <= names, "setup.py's sglang extra should name sglang-router too"


def test_megappo_is_installed_from_the_copied_source():
    instructions = _instructions()
    workdir = next(rest for word, rest in instructions if word == "WORKDIR")
    copied = [rest.split()[0] for word, rest in instructions if word == "COPY"]
    assert "setup.py" in copied and "megappo" in copied, copied
    args, _ = _local_install()
    assert "-e" not in args and "--editable" not in args, "the image is a release: not an editable install"
    assert workdir == "/opt/megappo"
    # the copy comes before the install
    order = [word for word, _ in instructions]
    first_copy = order.index("COPY")
    install_at = next(i for i, (word, rest) in enumerate(instructions)
                      if word == "RUN" and re.search(r"pip install[^&]* \"?\.(\[|\"| |$)", rest))
    assert first_copy < install_at


def test_the_cuda_toolkit_is_the_one_torch_was_built_for():
    """transformer-engine and apex compile against the base image's toolkit and torch's headers: their CUDA
    versions must agree (the build asserts torch's)."""
    base = _args()["CUDA_IMAGE"]
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-cudnn-devel-ubuntu(\d+\.\d+)", base)
    assert m, f"base image {base!r}: expected a pinned nvidia/cuda devel tag"
    asserted = re.search(r"torch\.version\.cuda == '([\d.]+)'", " ".join(_runs()))
    assert asserted and asserted.group(1) == f"{m.group(1)}.{m.group(2)}"
    # Ubuntu 24.04 ships the Python the image names
    assert (m.group(3), _args()["PYTHON_VERSION"]) == ("24.04", "3.12")


@pytest.mark.parametrize("name", STACK)
def test_each_stack_pin_is_exact(name):
    pins, args = _constraints(), _args()
    if name == "apex":
        assert re.fullmatch(r"[0-9a-f]{40}", args["APEX_COMMIT"])
    else:
        assert name in pins and not pins[name].is_prerelease
