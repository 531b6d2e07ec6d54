"""servegate's import-only stand-in for SGLang's kernel library (``sgl_kernel``), installed by
``servegate engine install sglang-cpu`` into that engine's virtualenv, never imported by servegate itself.

No CPU build of SGLang's kernel library is on the package index (SGLang's own CPU CI builds it from source,
for CPUs with AMX), yet SGLang imports a few of its CPU symbols at module import. On a CPU without AMX,
SGLang's CPU server takes its torch-native paths and calls none of them. So every name here, and every name
of every submodule (``sgl_kernel.speculative``...), is a placeholder that computes nothing: calling one
raises :class:`StandInKernelError` naming it, so a feature that needs a real kernel (NGRAM speculation)
fails loudly instead of computing something else. ``STANDIN`` says which library this is.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+servegate.standin"
STANDIN = True


class StandInKernelError(NotImplementedError):
    """A kernel of the stand-in was called."""


class _Missing:
    """A name of the kernel library: its attributes are more such names; calling one raises."""

    def __init__(self, qualname):
        self.__qualname__ = qualname
        self.__name__ = qualname.rsplit(".", 1)[-1]

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__qualname__}.{name}")

    def __call__(self, *args, **kwargs):
        raise StandInKernelError(
            f"sgl_kernel.{self.__qualname__} was called, but this sgl_kernel is servegate's import-only stand-in "
            "(no CPU build of SGLang's kernel library installs here): this SGLang feature cannot run on this "
            "machine")

    def __repr__(self):
        return f"<sgl_kernel stand-in {self.__qualname__}>"


def _module_getattr(prefix):
    def __getattr__(name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Missing(prefix + name)

    return __getattr__


__getattr__ = _module_getattr("")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of ``sgl_kernel.<anything>`` give a module of placeholders as well."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name[len(__name__) + 1:] + ".")
        module.STANDIN = True
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_SubmoduleFinder())
