"""An agent for a container image that holds nothing but Python's standard library: it drops the CA
variables, so only the image's own system CA store is trusted, asks the model one question at
https://api.openai.invalid/v1 through ``$HTTPS_PROXY``, prints the answer, and its reward (1) last."""

import json
import os
import ssl
import urllib.request

for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS"):
    os.environ.pop(name, None)
context = ssl.create_default_context()  # OpenSSL's default paths: the image's system store
question = os.environ.get("TASK_QUESTION", "What is 2+3?")
messages = [{"role": "user", "content": question}]
body = json.dumps({"model": "agent-model", "max_tokens": 32, "messages": messages})
request = urllib.request.Request("https://api.openai.invalid/v1/chat/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer sk"})
https = urllib.request.HTTPSHandler(context=context)
with urllib.request.build_opener(urllib.request.ProxyHandler(), https).open(request, timeout=20) as answer:
    print("model said:", json.load(answer)["choices"][0]["message"]["content"])
print(1)
