// An ordinary single-turn agent in Node.js on the official openai npm package. It knows nothing of lgt.
//
// It reads its task from the environment (TASK_QUESTION, TASK_ANSWER), asks the model once, grades
// the answer itself and prints {"answer": "...", "reward": 1.0} as its last line — the arith example's
// agent (examples/arith/agent.py), in another language. The model is whatever OPENAI_BASE_URL serves
// (a hosted API under a reserved name that never resolves: under lgt-proxy, the policy being trained).
import OpenAI from "openai";

const question = process.env.TASK_QUESTION ?? "What is 3+4?";
const answer = process.env.TASK_ANSWER ?? "7";
const client = new OpenAI(); // OPENAI_BASE_URL and OPENAI_API_KEY from the environment
const reply = await client.chat.completions.create({
  model: "gpt-4o-mini",
  messages: [{ role: "user", content: question }],
  temperature: 1.0,
  max_tokens: 24,
});
const choice = reply.choices[0];
const text = choice.message.content ?? "";
const ok = choice.finish_reason === "stop" && text.trim() === `The answer is ${answer}.`;
console.log(JSON.stringify({ answer: text, reward: ok ? 1.0 : 0.0 }));
