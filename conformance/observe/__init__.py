"""What a backend actually did: its Triton kernel launches, and the kernel paths they ran."""
