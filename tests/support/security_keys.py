"""What the security tests (tests/scheduler/test_security*.py) share: two valid
API keys of the key file (alice's, bob's), one that no file holds, a prompt
distinctive enough to search the logs for, and the calls' timeout."""

from __future__ import annotations

ALICE = "alice-0123456789abcdef0123456789abcdef"
BOB = "bob-fedcba9876543210fedcba9876543210"
WRONG = "mallory-00000000000000000000000000000"
PROMPT = "zebra quokka passphrase xylophone"     # distinctive: searched for in the logs
TIMEOUT = 10.0
