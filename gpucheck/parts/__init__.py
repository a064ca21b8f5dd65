"""The kit's five parts; each module has FILE and run(ctx, writer, budget)."""
