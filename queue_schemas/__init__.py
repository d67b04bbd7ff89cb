"""The contract between sluice's services: message models, names, wire encoding and shared settings.

Data only: nothing here starts a loop or opens a connection.
"""
