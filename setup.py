"""The package's one native part: the keeper's data plane (src/leto/protection/dataplane.c), a
plain C library that `leto.protection.dataplane` loads with ctypes. Optional: without a C
compiler the package installs without it and keepers run their Python data plane."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "leto.protection._dataplane",
            ["src/leto/protection/dataplane.c"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
