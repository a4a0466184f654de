"""Internal: the version of nebula_ckpt: the one place it is written.

``setup.py`` reads this file without importing the package (it parses the assignment below) and
compiles the same string into the C++ extension (``NEBULA_VERSION``, reported by
``_C.build_info()["version"]``); ``nebula_ckpt.__version__`` is imported from here.
"""

__version__ = "0.1.0"
