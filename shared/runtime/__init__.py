"""How the stages run: processes and ranks, devices, errors a user can cause, progress, durable writes,
run settings, one run per output folder."""
