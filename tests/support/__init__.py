"""What the test modules share (fixtures stay in tests/conftest.py): the suite's tiers, and the helpers many
modules use. No test module imports another test module; what two of them need lives here."""
