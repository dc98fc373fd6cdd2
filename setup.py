"""The license, and nothing else: every other setting is in pyproject.toml.

setuptools 77 replaced the ``license = {text = ...}`` table of ``pyproject.toml`` with an SPDX
string (``license = "Apache-2.0"``) and warns about the table, which new releases stop
accepting after 2027-02-18; setuptools before 77 rejects the string.  ``pyproject.toml``
declares the license dynamic, and this sets it in the form the installed setuptools knows, so
the project builds, without a warning, with every setuptools from 68 on.
"""

import setuptools

LICENSE = "Apache-2.0"

if int(setuptools.__version__.split(".")[0]) >= 77:
    setuptools.setup(license_expression=LICENSE)  # core metadata's License-Expression
else:
    setuptools.setup(license=LICENSE)  # the free-text License field, as before
