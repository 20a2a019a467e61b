"""An agent process using aiohttp: ``python aiohttp_agent.py URL JSON_BODY`` prints
``{"status", "content_type", "body"}`` as JSON (the body as text; an SSE stream read line by line).

Run as its own process with the rollout's environment, as an agent would be: aiohttp builds its
default SSL context when it is imported, so SSL_CERT_FILE must be set before that.
"""

import asyncio
import json
import sys

import aiohttp


async def main(url: str, body: str) -> dict:
    async with aiohttp.ClientSession(trust_env=True) as session:  # HTTP(S)_PROXY from the env
        async with session.post(url, data=body, timeout=aiohttp.ClientTimeout(total=20),
                                headers={"Content-Type": "application/json",
                                         "Authorization": "Bearer sk-aiohttp"}) as r:
            lines = [line.decode() async for line in r.content]
            return {"status": r.status, "content_type": r.headers.get("Content-Type", ""),
                    "body": "".join(lines), "lines": len(lines)}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
