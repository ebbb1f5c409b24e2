"""The bottom layer: shared types, settings, the sample store, records, metrics, activity.

Everything else imports from here; nothing here imports the engine, the model or the HTTP
layer, so reading settings or a stored sample never loads torch.
"""
