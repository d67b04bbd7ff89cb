"""The OpenAI API as sluice serves it, shared by ingress and the dispatcher's batch intake: request and
response types, errors, admission, structured-output checks, the tokenizer and the quota gate."""
