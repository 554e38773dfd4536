"""Prompts for distilling the draft, written for this project, with a fixed held-out split.

Variety comes from templates x topics: chat answers, code, lists, short facts, and IME-style
raw prefixes (what a user is typing; no chat template). The split is by *topic* (and, for the
IME prefixes, by the prefix itself), decided by a stable hash, so a held-out prompt shares no
topic with any training prompt. ``shared.prompts.CHAT_PROMPTS`` (the benchmark's prompts) is
never in the training split.

``prompt_split("heldout")`` is what ``edge-client bench-acceptance`` evaluates on.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from typing import Literal

# One topic bucket in HELDOUT_BUCKETS out of NUM_BUCKETS is held out.
NUM_BUCKETS = 10
HELDOUT_BUCKETS = frozenset({3})


@dataclass(frozen=True)
class DistillPrompt:
    text: str
    kind: str  # "chat", "code", "list", "fact" or "ime"
    chat: bool  # True: wrap in the chat template; False: raw text prefix


# --- chat answers: explanation/advice templates x general topics ------------------------------

_CHAT_TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "inflation", "vaccines", "volcanoes",
    "the French Revolution", "machine learning", "compound interest", "plate tectonics",
    "the immune system", "climate change", "electric cars", "the stock market", "sleep",
    "meditation", "recycling", "the moon landing", "DNA", "the internet", "solar panels",
    "earthquakes", "the Roman Empire", "supply and demand", "coffee", "bees", "rainbows",
    "tides", "the human heart", "antibiotics", "democracy", "the printing press", "jazz music",
    "chess", "gardening", "budgeting", "public speaking", "time management", "learning a language",
    "running a marathon", "baking bread", "the northern lights", "gravity", "magnets",
    "batteries", "cloud computing", "encryption", "blockchains", "the Great Wall of China",
    "the Amazon rainforest", "coral reefs", "dinosaurs", "evolution", "the speed of light",
    "nuclear energy", "wind turbines", "3D printing", "remote work", "job interviews",
    "first aid", "healthy breakfasts", "houseplants", "dogs as pets", "cats as pets",
    "the Olympic Games", "football", "origami", "photography", "writing a novel",
    "the periodic table", "viruses", "bacteria", "the ozone layer", "glaciers", "deserts",
    "hurricanes", "the Renaissance", "ancient Egypt", "the Silk Road", "the Industrial Revolution",
    "credit scores", "mortgages", "taxes", "saving for retirement", "negotiating a salary",
    "teamwork", "procrastination", "stress", "hydration", "vitamins", "yoga", "camping",
    "traveling on a budget", "packing for a trip", "moving to a new city", "making friends",
    "the scientific method", "probability", "prime numbers", "fractions", "algebra",
)

_CHAT_TEMPLATES = (
    "Explain {t} in simple terms.",
    "What should a beginner know about {t}?",
    "Write a short paragraph about {t}.",
    "Why does {t} matter? Answer briefly.",
    "Give me a one-sentence summary of {t}.",
    "Explain {t} to a ten-year-old.",
    "What are common misconceptions about {t}?",
    "Write a short blog intro about {t}.",
    "Can you tell me something interesting about {t}?",
    "How would you describe {t} to a friend?",
    "What is the history of {t} in a few sentences?",
    "Write a tweet about {t}.",
)

# --- code: task templates x languages, plus some concrete tasks --------------------------------

_CODE_LANGS = ("Python", "JavaScript", "C", "Go", "Rust", "Java", "Bash", "TypeScript")
_CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "computes a factorial",
    "sorts a list of numbers", "counts the words in a sentence", "finds the maximum of a list",
    "removes duplicates from a list", "reads a file line by line", "computes the average of a list",
    "checks whether a string is a palindrome", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "returns the n-th Fibonacci number", "flattens a nested list",
    "counts the vowels in a string", "finds the greatest common divisor of two numbers",
    "implements binary search", "validates an email address", "capitalizes every word",
    "sums the digits of a number", "generates a random password", "transposes a matrix",
    "checks whether two strings are anagrams", "computes the length of a linked list",
)
_CODE_TEMPLATES = (
    "Write a {lang} function that {task}.",
    "Show me {lang} code that {task}.",
    "How do I write a program in {lang} that {task}?",
)
_SQL_TASKS = (
    "Write a SQL query that selects all orders placed in 2024.",
    "Write a SQL query that finds the ten most expensive products.",
    "Write a SQL query that joins customers with their orders.",
    "Write a SQL query that counts users per country.",
    "Write a SQL query that deletes rows with an empty email column.",
    "Explain what a LEFT JOIN does in SQL.",
    "What is the difference between a list and a tuple in Python?",
    "Explain recursion with a short Python example.",
    "What does the 'git rebase' command do?",
    "How do I create a virtual environment in Python?",
    "Explain what an API is, with a short example.",
    "What is the difference between TCP and UDP?",
    "How do I read a JSON file in Python?",
    "Explain Big O notation with an example.",
    "What is a race condition?",
    "How does a for loop work in JavaScript?",
)

# --- lists: list templates x list subjects ----------------------------------------------------

_LIST_SUBJECTS = (
    "vegetables that grow well in pots", "famous painters", "European capitals",
    "ways to save energy at home", "board games for families", "healthy snacks",
    "programming languages", "musical instruments", "tips for studying", "rainy day activities",
    "birds found in cities", "ways to reduce plastic waste", "classic novels",
    "things to pack for the beach", "exercises you can do at home", "herbs for cooking",
    "questions to ask in a job interview", "uses for baking soda", "ocean animals",
    "careers in science", "breakfast ideas", "hobbies for retirees", "podcast topics",
    "names for a pet goldfish", "ways to be more productive", "desserts from France",
    "inventions of the 20th century", "mammals that live in the Arctic", "kitchen tools",
    "gift ideas for a teacher", "Linux commands", "team building activities",
    "signs of dehydration", "spices used in Indian cooking", "national parks in the USA",
)
_LIST_TEMPLATES = (
    "List five {s}.",
    "Name three {s}.",
    "Give me a bulleted list of {s}.",
    "What are some {s}? Give a numbered list.",
    "Suggest seven {s}, one per line.",
)

# --- short facts: question templates x entities -----------------------------------------------

_COUNTRIES = (
    "France", "Japan", "Brazil", "Canada", "Egypt", "India", "Kenya", "Mexico", "Norway",
    "Australia", "Argentina", "Germany", "Italy", "Spain", "Peru", "Vietnam", "Turkey",
    "Ireland", "Chile", "Greece", "Poland", "Portugal", "Thailand", "Morocco", "Sweden",
    "New Zealand", "South Korea", "Nigeria", "Indonesia", "Finland",
)
_COUNTRY_FACTS = (
    "What is the capital of {c}?",
    "What language is spoken in {c}?",
    "What currency does {c} use?",
    "What is {c} famous for? Answer in one sentence.",
    "On which continent is {c}?",
)
_FACT_QUESTIONS = (
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?",
    "Who wrote Hamlet?", "What is the largest planet in our solar system?",
    "How many continents are there?", "What gas do plants absorb from the air?",
    "What is the chemical symbol for gold?", "How many minutes are in a day?",
    "What is the tallest mountain on Earth?", "Who painted the Mona Lisa?",
    "What is the freezing point of water in Fahrenheit?", "How many bones are in the human body?",
    "What is the square root of 144?", "What is the longest river in Africa?",
    "Which planet is known as the Red Planet?", "How many sides does a hexagon have?",
    "What is the smallest prime number?", "Who discovered penicillin?",
    "What is the hardest natural substance?", "How many hours are in a week?",
    "What is the main ingredient in guacamole?", "What is 15 percent of 200?",
    "In what year did World War II end?", "What is the speed of sound in air, roughly?",
    "What does CPU stand for?", "What is the largest ocean?",
    "How many strings does a violin have?",
    "What is the capital of Australia?", "What is H2O commonly called?",
    "How many teeth does an adult human have?",
)
_NUMBERS = (7, 12, 19, 23, 36, 48, 64, 81, 99, 125)
_ARITH_TEMPLATES = (
    "What is {a} times {b}?",
    "What is {a} plus {b}?",
    "Is {a} an even number?",
    "Convert {a} kilometers to miles.",
)

# --- IME: raw prefixes a user might be typing (no chat template) ------------------------------

_IME_STARTS = (
    "I'll be home around", "Thanks so much for the", "Can you send me the", "Sorry I missed your",
    "Let's meet at the", "Don't forget to bring", "I think we should", "Happy birthday! I hope",
    "The meeting has been moved to", "Just a quick reminder that", "I'm running a bit late because",
    "Could you please", "Hope you're doing well. I wanted to", "The weather today is",
    "My favorite part of the weekend was", "We need to buy", "Are you free on",
    "I really enjoyed the", "Please let me know if", "The best way to get there is",
    "Good morning everyone, today we", "I'm not sure if", "Once upon a time, there was a",
    "In conclusion, the results show that", "The quick brown fox", "Dear hiring manager, I am",
    "To install the package, run", "The recipe calls for two cups of", "Our team is excited to",
    "I have a question about", "It was a dark and stormy night", "The main reason I",
    "Thank you for your patience while", "Remember to water the", "Can we reschedule our",
    "The new update includes", "On Monday I will", "My name is Sarah and I",
    "The train leaves at", "If you have any questions,", "First, preheat the oven to",
    "The capital of Italy is", "Python is a programming language that", "Call me when you",
    "I can't believe that", "The store closes at", "Looking forward to seeing",
    "Water boils at", "The project deadline is", "Sounds good, I'll",
)
_IME_NAMES = ("", "Hi Tom, ", "Hey Anna, ", "Hello team, ", "Mom, ", "Hi all, ")


# --- extra training topics (added for draft v4) -----------------------------------------------
# Only ever trained on: an extra topic that hashes into a held-out bucket is dropped rather than
# added to the held-out split, so every draft is measured on the same held-out prompts.

_EXTRA_CHAT_TOPICS = (
    "the Moon's phases", "octopuses", "the Eiffel Tower", "hot air balloons", "submarines",
    "the Sahara", "wolves", "honey", "chocolate", "tea ceremonies", "the violin", "opera",
    "hip hop", "street art", "architecture", "bridges", "skyscrapers", "trains", "airplanes",
    "rockets", "satellites", "Mars", "Jupiter", "comets", "telescopes", "microscopes",
    "the human brain", "memory", "dreams", "emotions", "habits", "motivation", "happiness",
    "friendship", "parenting", "toddlers", "teenagers", "grandparents", "weddings", "birthdays",
    "holidays", "New Year resolutions", "cooking pasta", "making soup", "grilling", "spices",
    "cheese", "bread yeast", "fermentation", "vegetarian diets", "food allergies", "sugar",
    "caffeine", "walking", "cycling", "swimming", "tennis", "basketball", "skiing", "surfing",
    "rock climbing", "hiking safety", "birdwatching", "fishing", "knitting", "woodworking",
    "painting with watercolors", "drawing", "poetry", "short stories", "libraries", "museums",
    "newspapers", "social media", "smartphones", "video games", "robots", "self-driving cars",
    "drones", "virtual reality", "passwords", "online privacy", "phishing emails", "open source",
    "databases", "spreadsheets", "email etiquette", "meetings", "leadership", "customer service",
    "starting a small business", "marketing", "advertising", "banks", "insurance", "renting",
    "buying a car", "minimalism", "cleaning the house", "laundry", "composting", "rain gardens",
    "forests", "rivers", "oceans", "mountains", "islands", "caves", "weather forecasts", "snow",
    "lightning", "fog", "seasons", "time zones", "calendars", "maps", "compasses",
    "the metric system",
    "geometry", "statistics", "logic puzzles", "riddles", "magic tricks", "circuses", "zoos",
    "elephants", "whales", "penguins", "butterflies", "ants", "mushrooms", "trees", "flowers",
)
_EXTRA_CODE_TASKS = (
    "counts how often each letter appears", "reverses the words in a sentence",
    "checks whether a year is a leap year", "converts a number to binary",
    "finds the second largest number in a list", "rotates a list by k positions",
    "removes whitespace from a string", "computes the power of a number",
    "splits a list into chunks of size n", "finds common elements of two lists",
    "checks whether a list is sorted", "computes the median of a list",
)
_EXTRA_LIST_SUBJECTS = (
    "fruits rich in vitamin C", "famous scientists", "Asian capitals", "ways to fall asleep faster",
    "card games", "picnic foods", "web browsers", "string instruments", "tips for a first job",
    "indoor plants that need little light", "ways to save money on groceries",
    "science fiction films",
    "things to do in a park", "stretches for back pain", "soup recipes", "dog breeds",
    "questions to ask a doctor", "uses for vinegar", "desert animals", "jobs in healthcare",
    "lunch ideas for kids", "skills to learn online", "board game night snacks",
    "things to check before a road trip", "Greek gods", "planets in the solar system",
    "types of clouds", "ways to stay cool in summer", "computer parts", "colors of the rainbow",
)
_EXTRA_FACT_QUESTIONS = (
    "How many days are in a leap year?", "What is the capital of Canada?",
    "Who invented the telephone?", "What is the largest mammal?", "How many planets are there?",
    "What is the chemical symbol for iron?", "How many seconds are in an hour?",
    "What is the largest desert in the world?", "Who wrote Pride and Prejudice?",
    "What is the main gas in Earth's atmosphere?", "How many players are on a soccer team?",
    "What does RAM stand for?", "What is the currency of the United Kingdom?",
    "How many weeks are in a year?", "What is the closest star to Earth?",
    "Which organ pumps blood through the body?", "What is 12 squared?",
    "What language has the most native speakers?", "How many colors are in a rainbow?",
    "What is the opposite of hot?",
)
_EXTRA_IME_STARTS = (
    "I just wanted to say", "Can you pick up some", "We're going to the", "Let me know when",
    "I'll call you after", "Thanks for letting me know", "I'm so sorry to hear",
    "See you tomorrow at",
    "The kids are", "Dinner is ready, so", "I forgot my", "Could we talk about",
    "The package should arrive", "I'm on my way to", "Congratulations on your",
    "Please find attached the",
    "As discussed in the meeting,", "I would like to apply for", "The results of the test",
    "My flight was delayed", "We have a reservation for", "I left the keys", "Are we still on for",
    "The doctor said that", "I finished reading the", "Our next step is to",
    "The password for the wifi is",
    "Quick question: do you", "It was great to see you", "I'm thinking about buying",
    "The weather forecast says", "Don't worry about the", "I booked a table at", "The car needs",
    "Can you remind me to", "I'm excited to announce", "Here is a summary of", "The file is too",
    "Let's try again on", "Happy anniversary! We",
)


# --- a second round of extra training topics (added for draft v5) -----------------------------

_EXTRA2_CHAT_TOPICS = (
    "lighthouses", "castles", "pyramids", "the Titanic", "the Vikings", "samurai", "knights",
    "pirates", "ancient Greece", "the Aztecs", "the Cold War", "the space station", "astronauts",
    "Saturn's rings", "the Milky Way", "meteor showers", "eclipses", "the Big Bang", "sunsets",
    "thunderstorms", "tornadoes", "droughts", "floods", "wildfires", "avalanches", "icebergs",
    "wetlands", "grasslands", "jungles", "lakes", "waterfalls", "canyons", "geysers",
    "sharks", "dolphins", "owls", "eagles", "parrots", "frogs", "snakes", "turtles", "spiders",
    "horses", "cows", "chickens", "sheep", "rabbits", "hamsters", "goldfish", "foxes", "bears",
    "lions", "tigers", "giraffes", "kangaroos", "koalas", "pandas", "camels", "bats",
    "potatoes", "rice", "apples", "bananas", "tomatoes", "olive oil", "pizza", "sushi", "tacos",
    "curry", "salads", "smoothies", "ice cream", "pancakes", "sandwiches", "breakfast cereal",
    "meal planning", "food waste", "table manners", "restaurants", "farmers markets",
    "the piano", "the guitar", "drums", "orchestras", "choirs", "musicals", "movies", "cartoons",
    "comic books", "board games", "puzzles", "crossword puzzles", "sudoku", "card tricks",
    "dancing", "ballet", "theater", "sculpture", "pottery", "sewing", "calligraphy", "scrapbooking",
    "journaling", "reading habits", "audiobooks", "podcasts", "radio", "television", "cinema",
    "email", "text messages", "video calls", "keyboards", "computer mice", "laptops", "tablets",
    "smartwatches", "headphones", "printers", "wifi routers", "search engines", "web browsers",
    "programming", "debugging", "unit tests", "version control", "code reviews", "algorithms",
    "data structures", "operating systems", "compilers", "artificial intelligence",
    "chatbots", "computer viruses", "backups", "cybersecurity", "two-factor authentication",
    "electricity", "light bulbs", "clocks", "bicycles", "motorcycles", "buses", "ships",
    "ports", "airports", "highways", "traffic lights", "parking", "carpooling", "public transport",
    "city parks", "playgrounds", "schools", "homework", "exams", "teachers", "universities",
    "scholarships", "online courses", "note taking", "reading comprehension", "spelling",
    "handwriting", "vocabulary", "grammar", "punctuation", "translation", "sign language",
    "volunteering", "charity", "voting", "elections", "laws", "courts", "police", "firefighters",
    "nurses", "doctors", "dentists", "pharmacies", "hospitals", "exercise routines", "stretching",
    "posture", "back pain", "headaches", "colds", "allergies", "sunscreen", "eye health",
    "hearing", "sleep hygiene", "naps", "breathing exercises", "mindfulness", "gratitude",
    "kindness", "patience", "honesty", "curiosity", "creativity", "confidence", "resilience",
)
_EXTRA2_CODE_TASKS = (
    "checks whether a number is even", "finds the minimum of a list", "sums a list of numbers",
    "repeats a string n times", "counts the lines in a file", "swaps two variables",
    "converts a string to uppercase", "finds the index of an item in a list",
    "computes the area of a circle", "prints the multiplication table of a number",
    "checks whether a string contains only digits", "merges two dictionaries",
)
_EXTRA2_LIST_SUBJECTS = (
    "things to do on a rainy afternoon", "African countries", "sea birds", "kinds of pasta",
    "winter sports", "summer fruits", "tools in a toolbox", "famous bridges",
    "reasons to learn to cook",
    "ways to make a house cozy", "things to bring to a picnic", "popular pet names",
    "famous composers", "words that rhyme with cat", "ways to say thank you",
    "healthy drinks", "jungle animals", "office supplies", "camping gear", "garden flowers",
    "classic toys", "mobile apps for learning", "ways to relax after work", "types of trees",
    "things found in a kitchen", "study habits of good students", "farm animals",
    "questions to ask a landlord", "party games for kids", "citrus fruits",
)
_EXTRA2_FACT_QUESTIONS = (
    "How many days are in a week?", "What is the capital of Japan?", "Who wrote Romeo and Juliet?",
    "What is the fastest land animal?", "How many hours are in a day?",
    "What is the chemical symbol for oxygen?", "How many months have 31 days?",
    "What is the largest country by area?", "Who was the first person to walk on the Moon?",
    "What do bees make?", "How many sides does a triangle have?", "What is 9 times 9?",
    "What is the tallest animal?", "Which planet is closest to the Sun?",
    "What color do you get by mixing blue and yellow?", "How many centimeters are in a meter?",
    "What is the capital of Germany?", "How many legs does an insect have?",
    "What is the largest bone in the human body?", "What does HTML stand for?",
)
_EXTRA2_IME_STARTS = (
    "I'm going to be", "Could you send me", "Thanks again for", "I hope you had a",
    "We should probably", "Just checking in to", "I'll bring the", "Can't wait to see",
    "The meeting starts at", "Did you get my", "I need to finish", "Would you like to",
    "The store was out of", "Please remember to", "I'm happy to help with", "Let's grab lunch",
    "The report is due", "I'll send you the", "We are looking for", "My phone is about to",
    "The game starts at", "Have a great", "I'm sorry, but I", "The invoice for",
    "Welcome to the team,", "We'll be closed on", "Your order has been", "I'm writing to ask",
    "Can I borrow your", "The bus was", "I just finished", "Let me check with",
    "Thanks for the quick", "We're almost out of", "I'll pick you up at", "Did you remember to",
    "The class has been", "I love the", "What time does the", "Good night, and",
)


# --- a third round of extra training topics (added for draft v6) ------------------------------

_EXTRA3_CHAT_TOPICS = (
    "the Eiffel Tower", "the Statue of Liberty", "Mount Everest", "the Sahara", "the Nile",
    "the Pacific Ocean", "Antarctica", "the Arctic", "islands", "rivers", "mountains", "caves",
    "fossils", "crystals", "gold", "diamonds", "iron", "copper", "salt", "sand", "clay", "glass",
    "plastic", "paper", "cotton", "wool", "silk", "leather", "rubber", "concrete", "steel",
    "bridges", "tunnels", "skyscrapers", "dams", "canals", "railways", "subways", "elevators",
    "escalators", "windmills", "water pipes", "sewers", "power plants", "the electric grid",
    "satellites", "rockets", "telescopes", "microscopes", "thermometers", "compasses", "maps",
    "GPS", "calendars", "time zones", "leap years", "the seasons", "the equator", "latitude",
    "weather forecasts", "clouds", "fog", "snow", "hail", "lightning", "wind", "humidity",
    "air pressure", "sound waves", "echoes", "colors", "mirrors", "lenses", "shadows", "heat",
    "friction", "energy", "atoms", "molecules", "acids and bases", "chemical reactions", "rust",
    "fire", "boiling water", "freezing", "evaporation", "condensation", "cells", "muscles",
    "bones", "the brain", "the lungs", "the stomach", "the skin", "teeth", "blood", "hormones",
    "genes", "twins", "growing up", "aging", "childhood", "teenagers", "grandparents",
    "family traditions", "birthdays", "weddings", "holidays", "New Year's resolutions",
    "gift giving", "thank-you notes", "manners", "apologizing", "listening", "friendship",
    "neighbors", "roommates", "pets and allergies", "adopting a cat", "training a puppy",
    "aquariums", "bird watching", "hiking", "fishing", "sailing", "swimming", "cycling",
    "skiing", "surfing", "tennis", "basketball", "baseball", "cricket", "golf", "rugby",
    "boxing", "martial arts", "rock climbing", "skateboarding", "bowling", "table tennis",
    "video games", "esports", "streaming services", "social media", "online shopping",
    "online privacy", "passwords", "spam email", "phishing", "smartphones", "apps",
    "screen time", "digital photos", "cloud storage", "open source software", "spreadsheets",
    "databases", "web design", "websites", "APIs", "robots", "self-driving cars", "drones",
    "virtual reality", "quantum computers", "semiconductors", "fiber optics", "radio waves",
    "bread", "cheese", "yogurt", "eggs", "chocolate", "tea", "honey", "sugar", "spices",
    "soup", "noodles", "beans", "nuts", "berries", "oranges", "carrots", "vegetarian meals",
    "cooking for one", "grocery lists", "kitchen safety", "leftovers", "fermentation",
    "banks", "credit cards", "debt", "insurance", "renting an apartment", "buying a car",
    "small businesses", "marketing", "advertising", "customer service", "startups",
    "freelancing", "resumes", "cover letters", "performance reviews", "meetings",
    "deadlines", "leadership", "mentoring", "feedback", "career changes", "retirement",
    "museums", "libraries", "zoos", "theme parks", "beaches", "national parks", "road trips",
    "train travel", "hotels", "passports", "jet lag", "souvenirs", "learning to drive",
    "recipes", "poetry", "fairy tales", "myths", "fables", "libraries in the digital age",
    "painting", "drawing", "knitting", "woodworking", "candle making", "home repairs",
    "cleaning the house", "laundry", "decluttering", "interior design", "composting",
    "bird feeders", "vegetable gardens", "lawns", "houseflies", "mosquitoes", "earthworms",
)
_EXTRA3_CODE_TASKS = (
    "checks whether a number is prime", "counts the vowels in a string",
    "finds the longest word in a sentence", "removes duplicates from a list",
    "converts Celsius to Fahrenheit", "computes the average of a list",
    "checks whether two strings are anagrams", "flattens a nested list",
    "capitalizes the first letter of each word", "finds the maximum value in a dictionary",
    "generates the first n Fibonacci numbers", "counts the words in a file",
)
_EXTRA3_LIST_SUBJECTS = (
    "European rivers", "kitchen spices", "breakfast foods", "ocean animals", "musical genres",
    "programming languages", "things to pack for the beach", "ways to reduce stress",
    "hobbies for retirees", "vegetables that grow fast", "famous painters", "team sports",
    "ways to be more productive", "things to do in winter", "birthday party ideas",
    "cheap date ideas", "useful phone apps", "types of bread", "ways to save energy at home",
    "mammals that live in water", "board games for families", "tips for better sleep",
    "famous inventions", "types of weather", "healthy snacks", "ways to learn faster",
    "wild cats", "things to say in a job interview", "cleaning supplies",
    "South American countries",
)
_EXTRA3_FACT_QUESTIONS = (
    "How many minutes are in an hour?", "What is the capital of Italy?",
    "Who painted the Mona Lisa?", "What is the freezing point of water in Celsius?",
    "How many continents are there?", "What is the chemical symbol for gold?",
    "What is the largest ocean?", "How many legs does a spider have?",
    "What is the capital of Australia?", "Who discovered penicillin?",
    "What is the square root of 64?", "How many days are in February in a normal year?",
    "What is the smallest prime number?", "Which planet is known as the Red Planet?",
    "What is the boiling point of water in Fahrenheit?", "How many strings does a violin have?",
    "What is the capital of Spain?", "What gas do plants take in?",
    "How many teeth does an adult human have?", "What does CPU stand for?",
)
_EXTRA3_IME_STARTS = (
    "I'll be there in", "Do you want to", "Sorry for the late", "I was wondering if",
    "Thank you so much for", "Can we move the", "I'm running a bit", "Let me know if you",
    "I think we should", "The train leaves at", "Please call me when", "I got the",
    "We need to talk about", "Is it okay if I", "I'll let you know", "Happy birthday! I hope",
    "The party is on", "I can't make it to", "Don't forget to bring", "How was your",
    "I'm at the", "The kids need to", "Could you please check", "I've attached the",
    "We just landed in", "My internet is", "I'll have the report", "Are you free on",
    "Good morning! Just a", "The appointment is at", "I really appreciate", "Could you help me",
    "We ran out of", "I'm heading home now", "Let's meet at the", "I'll be working from",
    "The price of the", "Thanks, that sounds", "I'm not sure if", "See you at the",
)


# --- a fourth round of extra training topics (added for draft v7) -----------------------------

_EXTRA4_CHAT_TOPICS = (
    "the Great Wall of China", "the Amazon rainforest", "the Grand Canyon", "the Alps",
    "the Mediterranean Sea", "volcanoes and islands", "coral reefs", "glaciers", "deserts at night",
    "tides", "ocean currents", "the water cycle", "the carbon cycle", "photosynthesis",
    "pollination", "bees", "ants", "butterflies", "spiders", "owls", "penguins", "dolphins",
    "whales", "sharks", "octopuses", "elephants", "giraffes", "lions", "wolves", "bears",
    "horses", "cows", "chickens", "frogs", "snakes", "turtles", "bats", "squirrels",
    "migration of birds", "hibernation", "camouflage", "food chains", "endangered species",
    "recycling plastic", "solar panels", "wind turbines", "electric cars", "batteries",
    "light bulbs", "magnets", "gravity", "the speed of light", "black holes", "the Moon",
    "the Sun", "Mars", "Jupiter", "comets", "meteor showers", "eclipses", "the Milky Way",
    "astronauts", "the International Space Station", "the first Moon landing", "the printing press",
    "the steam engine", "the telephone", "the internet's history", "the Roman Empire",
    "ancient Egypt", "ancient Greece", "the Middle Ages", "the Renaissance", "castles",
    "knights", "pirates", "the Vikings", "the Silk Road", "the Industrial Revolution",
    "the history of money", "the Olympic Games", "the World Cup", "marathons", "yoga",
    "stretching", "meditation", "breathing exercises", "posture", "walking every day",
    "drinking enough water", "vitamins", "breakfast", "caffeine", "naps", "dreams",
    "memory", "habits", "motivation", "procrastination", "goal setting", "journaling",
    "gratitude", "patience", "kindness", "honesty", "courage", "curiosity", "humor",
    "public speaking", "negotiation", "making small talk", "writing emails",
    "writing a short story", "reading more books", "learning a language", "learning to code",
    "learning math", "studying for exams", "taking notes", "online courses", "homeschooling",
    "teachers", "school uniforms", "homework", "summer camp", "college applications",
    "scholarships", "student loans", "budgeting", "saving money", "investing", "taxes",
    "inflation", "interest rates", "the stock market", "cryptocurrency", "shopping on a budget",
    "coupons", "tipping", "splitting bills", "moving to a new city", "packing boxes",
    "furniture", "houseplants", "lighting a room", "painting walls", "fixing a leaky faucet",
    "unclogging a drain", "changing a tire", "car maintenance", "bicycle repair",
    "camping", "building a campfire", "tents", "picnics", "barbecues", "baking cookies",
    "making pizza", "pasta", "rice", "salads", "sandwiches", "smoothies", "coffee",
    "breakfast cereal", "apples", "bananas", "potatoes", "tomatoes", "garlic", "mushrooms",
    "olive oil", "butter", "ice cream", "cakes", "pancakes", "soup for a cold day",
    "meal prepping", "food allergies", "reading food labels", "street food", "restaurants",
    "music lessons", "the piano", "the guitar", "drums", "singing", "choirs", "orchestras",
    "jazz", "classical music", "pop music", "concerts", "podcasts", "audiobooks", "movies",
    "cartoons", "comic books", "photography", "filmmaking", "theater", "dance", "magic tricks",
    "puzzles", "chess", "card games", "crossword puzzles", "collecting stamps", "origami",
    "pottery", "sewing", "embroidery", "calligraphy", "model trains", "kites", "board games",
    "email etiquette", "video calls", "working from home", "open offices", "commuting",
    "job interviews", "salary negotiation", "teamwork", "conflict at work", "burnout",
    "time management", "to-do lists", "project planning", "presentations", "customer feedback",
    "product design", "user interfaces", "software testing", "debugging", "version control",
    "code reviews", "documentation", "cybersecurity", "encryption", "backups", "computer viruses",
    "keyboards", "laptops", "printers", "Wi-Fi", "Bluetooth", "smart homes", "smartwatches",
    "artificial intelligence", "chatbots", "machine translation", "search engines",
)
_EXTRA4_CODE_TASKS = (
    "reverses the words in a sentence", "checks whether a year is a leap year",
    "sums the digits of a number", "finds the second largest number in a list",
    "counts how often each character appears in a string", "merges two sorted lists",
    "converts a binary string to an integer", "finds the common elements of two lists",
    "checks whether a string contains only digits", "computes the factorial of a number",
    "rotates a list by k positions", "returns the median of a list of numbers",
)
_EXTRA4_LIST_SUBJECTS = (
    "Asian capitals", "farm animals", "citrus fruits", "kitchen tools", "winter sports",
    "things to do on a rainy day", "ways to make friends in a new city", "gifts for a teacher",
    "classic novels", "science museums", "types of clouds", "desert animals",
    "ways to save water", "study tips for students", "camping essentials",
    "ideas for a weekend trip", "things to check before a long drive", "indoor plants",
    "healthy breakfast ideas", "ways to stay warm", "famous scientists", "musical instruments",
    "African countries", "ways to reduce waste", "questions to ask a doctor",
    "features of a good resume", "office supplies", "rainy day games for kids",
    "ways to relax after work", "planets in the solar system",
)
_EXTRA4_FACT_QUESTIONS = (
    "How many hours are in a day?", "What is the capital of Japan?",
    "Who wrote Romeo and Juliet?", "What is the largest planet in our solar system?",
    "How many sides does a hexagon have?", "What is the chemical symbol for water?",
    "What is the tallest animal?", "How many weeks are in a year?",
    "What is the capital of Canada?", "Who invented the light bulb?",
    "What is 12 times 12?", "How many players are on a soccer team?",
    "What is the hardest natural substance?", "Which ocean is the largest?",
    "What is the capital of Germany?", "How many bones are in the human body?",
    "What language is spoken in Brazil?", "What is the longest river in the world?",
    "How many colors are in a rainbow?", "What does RAM stand for?",
)
_EXTRA4_IME_STARTS = (
    "I'm on my way to", "Could you send me the", "We should grab", "Sorry, I missed your",
    "Just wanted to check if", "The meeting got moved to", "I'll call you after",
    "Don't worry about the", "Can you pick up some", "I left my", "We're going to be late for",
    "Thanks again for the", "Let's plan to", "I'm so happy that", "Did you get my",
    "Please remind me to", "I'm free after", "The package arrived", "How about we",
    "I'll bring the", "Just got home and", "Are we still on for", "It was great to see",
    "I'll send you the", "Can you believe", "The doctor said", "My flight is",
    "Remember to lock the", "We're out of milk so", "I'm looking forward to",
    "The weather today is", "Could you give me a", "I'll be back by", "Hope you're feeling",
    "Let me think about", "I need to finish", "The store closes at", "Congrats on your",
    "Is there anything I", "Talk to you",
)


Keyed = list[tuple[DistillPrompt, str]]  # a prompt and the key its split is decided by


def _chat(topics) -> Keyed:
    return [(DistillPrompt(tpl.format(t=t), "chat", True), f"chat:{t}")
            for t in topics for tpl in _CHAT_TEMPLATES]


def _code(tasks) -> Keyed:
    return [(DistillPrompt(tpl.format(lang=lang, task=task), "code", True), f"code:{task}")
            for task in tasks for lang in _CODE_LANGS for tpl in _CODE_TEMPLATES]


def _lists(subjects) -> Keyed:
    return [(DistillPrompt(tpl.format(s=s), "list", True), f"list:{s}")
            for s in subjects for tpl in _LIST_TEMPLATES]


def _facts(questions) -> Keyed:
    return [(DistillPrompt(text, "fact", True), f"fact:{text}") for text in questions]


def _ime(starts) -> Keyed:
    return [(DistillPrompt(name + start, "ime", False), f"ime:{start}")
            for start in starts for name in _IME_NAMES]


# Each extra split's (chat topics, code tasks, list subjects, fact questions, IME starts).
_EXTRA_TABLES = {
    "extra": (_EXTRA_CHAT_TOPICS, _EXTRA_CODE_TASKS, _EXTRA_LIST_SUBJECTS,
              _EXTRA_FACT_QUESTIONS, _EXTRA_IME_STARTS),
    "extra2": (_EXTRA2_CHAT_TOPICS, _EXTRA2_CODE_TASKS, _EXTRA2_LIST_SUBJECTS,
               _EXTRA2_FACT_QUESTIONS, _EXTRA2_IME_STARTS),
    "extra3": (_EXTRA3_CHAT_TOPICS, _EXTRA3_CODE_TASKS, _EXTRA3_LIST_SUBJECTS,
               _EXTRA3_FACT_QUESTIONS, _EXTRA3_IME_STARTS),
    "extra4": (_EXTRA4_CHAT_TOPICS, _EXTRA4_CODE_TASKS, _EXTRA4_LIST_SUBJECTS,
               _EXTRA4_FACT_QUESTIONS, _EXTRA4_IME_STARTS),
}
EXTRA_SPLITS = tuple(_EXTRA_TABLES)


def _extra_prompts(split: str) -> Keyed:
    chat, code, lists, facts, ime = _EXTRA_TABLES[split]
    return _chat(chat) + _code(code) + _lists(lists) + _facts(facts) + _ime(ime)


def _topic_bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % NUM_BUCKETS


def _all_prompts() -> Keyed:
    """Every base prompt with the key its split is decided by."""
    out = _chat(_CHAT_TOPICS) + _code(_CODE_TASKS)
    out += [(DistillPrompt(text, "code", True), f"code1:{text}") for text in _SQL_TASKS]
    out += _lists(_LIST_SUBJECTS)
    out += [(DistillPrompt(tpl.format(c=c), "fact", True), f"country:{c}")
            for c in _COUNTRIES for tpl in _COUNTRY_FACTS]
    out += _facts(_FACT_QUESTIONS)
    for a in _NUMBERS:
        for b in _NUMBERS[:5]:
            for tpl in _ARITH_TEMPLATES:
                if "{b}" not in tpl and b != _NUMBERS[0]:
                    continue
                out.append((DistillPrompt(tpl.format(a=a, b=b), "fact", True), f"num:{a}"))
    return out + _ime(_IME_STARTS)


@cache
def _split() -> dict[str, tuple[DistillPrompt, ...]]:
    from shared.prompts import CHAT_PROMPTS

    benchmark = set(CHAT_PROMPTS)
    train, heldout, seen = [], [], set()
    for prompt, key in _all_prompts():
        if prompt.text in seen:
            continue
        seen.add(prompt.text)
        if _topic_bucket(key) in HELDOUT_BUCKETS:
            heldout.append(prompt)
        elif prompt.text not in benchmark:
            train.append(prompt)
    out = {"train": tuple(train), "heldout": tuple(heldout)}
    for split in EXTRA_SPLITS:  # in order: a later split skips what an earlier one has
        extra = []
        for prompt, key in _extra_prompts(split):
            # a held-out topic's key always hashes into a held-out bucket
            if (prompt.text in seen or prompt.text in benchmark
                    or _topic_bucket(key) in HELDOUT_BUCKETS):
                continue
            seen.add(prompt.text)
            extra.append(prompt)
        out[split] = tuple(extra)
    return out


SPLITS = ("train", "heldout", *EXTRA_SPLITS)


def prompt_split(name: Literal["train", "heldout", "extra", "extra2", "extra3", "extra4"],
                 ) -> list[DistillPrompt]:
    """A split's prompts, in a fixed order (deterministic across runs).

    ``extra``, ``extra2``, ``extra3`` and ``extra4`` are further training splits on topics that
    no earlier split has;
    ``heldout`` is the same whether or not they exist.
    """
    splits = _split()
    if name not in splits:
        raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
    return list(splits[name])
