"""Stand-in for the CUDA/AMX `sgl_kernel` package so SGLang imports on a CPU without AMX.

Every attribute (also of submodules such as sgl_kernel.kvcacheio) is a stub: calling it raises
NotImplementedError; attribute access on a stub yields another stub. On CPU without AMX SGLang's layers
fall back to native torch, so no stub is called for the dense models checked here.
"""
import sys
import types

__version__ = "0.0.0+stub"


class _Stub:
    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is a stand-in (sgl_kernel stub, no real kernels on this CPU)")

    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Stub(f"{self._name}.{item}")

    def __repr__(self):
        return f"<sgl_kernel stub {self._name}>"


class _StubModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Stub(f"{self.__name__}.{item}")


class _Finder:
    """Serves any `sgl_kernel.<sub>` import with a stub module."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        import importlib.machinery
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, _Loader(), is_package=True)
        return None


class _Loader:
    @staticmethod
    def create_module(spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    @staticmethod
    def exec_module(module):
        pass


__path__ = []  # a package, submodules come from _Finder
sys.meta_path.append(_Finder())


def __getattr__(item):
    if item.startswith("__"):
        raise AttributeError(item)
    return _Stub(f"sgl_kernel.{item}")
