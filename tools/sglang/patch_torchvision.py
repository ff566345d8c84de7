# Lets torchvision (PyPI CUDA build) import next to torch+cpu: skip registering meta/autograd kernels for
# torchvision's C++ ops when its _C extension could not be loaded (it links libtorch_cuda).
import pathlib, sys
p = pathlib.Path(sys.argv[1]) / "torchvision" / "__init__.py"
s = p.read_text()
old = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,"""
new = """if extension._has_ops():  # patched: the CUDA wheel's _C.so does not load next to torch+cpu
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
from torchvision import (
    datasets,"""
assert old in s or new in s, "unexpected torchvision/__init__.py"
p.write_text(s.replace(old, new))
print("patched", p)
