"""Helpers the test modules share: builders, inputs and comparisons, one module per subject.

Test modules import from here (or from conftest.py and modern_models.py), never from one another, so each test
module can run, change or go alone; tests/test_layout.py checks it.
"""
