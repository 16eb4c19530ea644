"""The gateway's kernel: what every floor of ``router/`` needs and what needs no other floor: errors, kvgate's own
credentials, tenants, the sections of the policy file read on several floors, metrics and logs."""
